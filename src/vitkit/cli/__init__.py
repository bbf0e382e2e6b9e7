"""The command line: a thin layer that maps flags and YAML onto the library's dataclasses."""
