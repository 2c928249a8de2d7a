"""`python -m jzyfa.bench`: the speed benchmark (jzyfa/bench/speed.py; --help lists its flags)."""

from jzyfa.bench.speed import run_main

if __name__ == "__main__":
    run_main()
