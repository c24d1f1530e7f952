"""RDR solvers (docs/design.md §5): "fast" at up to 10^6 states, "milp" at up to 10^4, and the
argsort the fast path is held against (its budget: 3× one argsort of n·(T+1) float64).

Instances come from rdr.synthetic_problem (the example ladder: 5 tiers + evict, 4 KiB pages,
20 % of the top-tier bytes), the case the tests and validation/solver_study.py (its speed
target) also use.
"""
import numpy as np

from spherical_kv_ref import rdr


def _problem(n):
    return rdr.synthetic_problem(n, num_groups=max(1, n // 2000))


class TimeFast:
    params = [10**4, 10**5, 10**6]
    param_names = ["states"]
    timeout = 300

    def setup(self, n):
        self.problem = _problem(n)
        rdr.solve(_problem(1000))               # compile the numba kernels outside the timing
        self.keys = np.random.default_rng(0).random(n * self.problem.num_options)

    def time_fast(self, n):
        rdr.solve(self.problem, method="fast")

    def time_argsort_reference(self, n):
        np.argsort(self.keys)

    def track_fast_gap(self, n):
        return rdr.solve(self.problem, method="fast").gap

    track_fast_gap.unit = "relative gap"


class TimeMilp:
    params = [10**3, 10**4]
    param_names = ["states"]
    timeout = 300
    number = 1
    repeat = 1

    def setup(self, n):
        self.problem = _problem(n)

    def time_milp(self, n):
        rdr.solve(self.problem, method="milp", mip_rel_gap=1e-4)
