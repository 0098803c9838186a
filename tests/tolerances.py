"""Tolerances for comparing floats that were computed twice.

float32 kernels differ between CPUs (Intel vs AMD, AVX2 vs AVX-512, oneDNN vs plain BLAS) and between
batch shapes (a row evaluated in a batch of 2 is not bit-equal to the same row alone: reductions run in
another order). Observed: 5e-6 on a critic value of magnitude 3.5 on an AMD EPYC. A recomputed value is
therefore compared with these, never with ``==`` or a default ``pytest.approx``; the margins stay orders of
magnitude below what a real bug moves (another seed, commit, state or chunk changes actions by >1e-2).
"""

# The same network output (action chunk, value, log-prob) recomputed in another batch, process or server.
RECOMPUTED_ATOL = 1e-4
RECOMPUTED_RTOL = 1e-4
