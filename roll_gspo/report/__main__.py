"""`python -m roll_gspo.report <output_dir> [<other_output_dir> ...] [-o out.html]`: write the run
report and print its path; further runs overlay their curves on the first's."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from roll_gspo.report import NotARunFolder, write_report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roll_gspo.report",
        description="Write a run's report: one self-contained HTML file (curves, phase timeline, samples, "
                    "warnings) that opens from disk offline. Two or more runs overlay their curves.")
    parser.add_argument("output_dir", help="the run's output folder (holds metrics.jsonl, rollouts/)")
    parser.add_argument("others", nargs="*", help="more runs whose curves are overlaid on the first's")
    parser.add_argument("-o", "--output", help="where to write the page (default <output_dir>/report.html)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.output_dir, args.others, args.output)
    except NotARunFolder as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the page's folder not writable, a file vanishing mid-read
        print(f"error: could not write the report: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
