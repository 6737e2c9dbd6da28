#!/usr/bin/env python3
"""`kvcodec calibrate ARGS` with the peak RSS printed to stderr after each phase (load, Fisher,
extraction, fit, report) as `[phase] NAME: S s, peak RSS M MB` lines, which calibrate_cost.py reads
from the same file as `/usr/bin/time -v`'s output:

    /usr/bin/time -v python benchmarks/probes/calibrate_phases.py --model smollm2-135m --out m.kvt 2> time.txt
"""

import resource
import sys
import time

import kvcodec.cli.calibrate as c
import kvcodec.models

T0 = time.perf_counter()


def rss(tag):
    print(
        f"[phase] {tag}: {time.perf_counter() - T0:.1f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB",
        file=sys.stderr,
        flush=True,
    )


def wrap(mod, name, tag):
    f = getattr(mod, name)

    def g(*a, **k):
        out = f(*a, **k)
        rss(tag)
        return out

    setattr(mod, name, g)


rss("imports")
wrap(kvcodec.models, "load_model", "load")
wrap(c, "_kv_from_model", "extract")
wrap(c, "_fisher", "fisher")
wrap(c, "_fit_uniform", "fit")
wrap(c, "_quality", "report")
c.command.main(sys.argv[1:], standalone_mode=False)
rss("end")
