#!/usr/bin/env python
"""Entry point: `python run_pipeline.py --config example_gspo.yaml [key=value ...]`.

Also what `ray job submit ... -- python run_pipeline.py ...` runs on a cluster's head node.
"""
import sys

from roll_gspo.cli import main

if __name__ == "__main__":
    sys.exit(main())
