from vitkit.cli.main import main

raise SystemExit(main())
