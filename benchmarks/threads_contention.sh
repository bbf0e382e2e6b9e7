#!/bin/bash
# default `vitkit train` quiet and with one core kept busy by another process; threads chosen vs forced 2
case "${1:-}" in -h|--help) sed -n "2,$((2))p" "$0" | sed "s/^# \{0,1\}//"; exit 0 ;; esac
cd "$(mktemp -d)"
run() { rm -rf /tmp/ct; /usr/bin/time -f "%e s wall" vitkit train --output /tmp/ct "$@" 2>&1 | grep -E "threads:|final:|s wall"; }
for round in 1 2; do
  echo "== round $round quiet, auto"; run
  echo "== round $round quiet, --threads 2"; run --threads 2
  python -c "while True: pass" & B=$!
  echo "== round $round busy, auto"; run
  echo "== round $round busy, --threads 2"; run --threads 2
  kill $B
done
