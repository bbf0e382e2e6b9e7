"""Not built yet."""
import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not implemented yet")
