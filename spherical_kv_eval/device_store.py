"""The evaluation's context stores on a torch device (``--device cuda``), held where the model
runs: the baselines' kept or quantized states and the dense reference's exact states
(``DeviceDenseStore``, the twin of the reference's ``DenseStore``), and Spherical KV's
compressed sequences (``DeviceSphericalStore``, the twin of ``SphericalStore``). The same
checks, attention and appends, in float64, tested equal to the reference's
(``tests/test_evaluate_device.py``).

Spherical KV's twin computes the reference's function (the code points the stored codes
name, logits and value sum in float64), not the CUDA kernels' (fp32 accumulation within the
fp16 error budget, docs/PERF_NOTES.md): the evaluation measures the method, and a GPU run's
rows must be the CPU run's. The kernels' agreement with the reference is tested on its own
(``tests/test_device_cache_smollm2.py``)."""
from __future__ import annotations

import numpy as np

from spherical_kv_ref.hf_store import DenseStore, SphericalStore


class _DeviceRows:
    """The reference store's growing rows on a torch device: (n, d) float64 rows that grow at
    the end in amortised O(1) per row (a decode step appends one)."""

    def __init__(self, a, device):
        import torch
        self._buf = torch.as_tensor(np.array(a, np.float64)).to(device)
        self._n = self._buf.shape[0]

    @property
    def rows(self):
        return self._buf[:self._n]

    def extend(self, x) -> None:
        import torch
        x = torch.as_tensor(np.asarray(x, np.float64)).to(self._buf.device)
        need = self._n + x.shape[0]
        if need > self._buf.shape[0]:
            grown = self._buf.new_empty((max(need, 2 * self._buf.shape[0], 16), self._buf.shape[1]))
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:need] = x
        self._n = need


class DeviceDenseStore(DenseStore):
    """``DenseStore`` whose states are float64 torch tensors on ``device``.

    keys, values: per layer (num_kv_heads, n, d) arrays or lists of per-head (n_h, d) arrays,
    checked as ``DenseStore`` checks them (ValueError naming the argument), then moved to the
    device. ``attend(layer, q, scale)`` takes q (num_q_heads, T, d) and returns (out
    (num_q_heads, T, d), lse (num_q_heads, T)) as float64 NumPy, which is what the
    ``spherical_kv`` attention hands a store and takes back; only q and the result cross to
    and from the device."""

    def __init__(self, keys, values, num_q_heads: int, nbytes: int, device="cuda",
                 bytes_per_state=None):
        import torch
        super().__init__(keys, values, num_q_heads, nbytes, bytes_per_state)
        self.device = torch.device(device)
        # the checked rows move to the device; the host copies go
        self.keys = [[_DeviceRows(r.rows, self.device) for r in layer] for layer in self.keys]
        self.values = [[_DeviceRows(r.rows, self.device) for r in layer] for layer in self.values]

    def attend(self, layer, q, scale):
        return _attend(self.device, [(r.rows, s.rows) for r, s in
                                     zip(self.keys[layer], self.values[layer])], q, scale)


def _attend(device, rows, q, scale):
    """Softmax attention of q (num_q_heads, T, d) over each kv-head's (keys, values) (n, d)
    float64 device tensors in ``rows`` (the query heads grouped in order), on ``device``:
    (out (num_q_heads, T, d), lse (num_q_heads, T)) float64 NumPy; a head with no states
    contributes no mass (out 0, lse −inf)."""
    import torch
    G = q.shape[0] // len(rows)
    qt = torch.as_tensor(np.asarray(q, np.float64)).to(device)
    out = torch.zeros(qt.shape, dtype=torch.float64, device=device)
    lse = torch.full(qt.shape[:2], -np.inf, dtype=torch.float64, device=device)
    for h, (k, v) in enumerate(rows):
        if k.shape[0] == 0:           # every state of this head evicted: no mass here
            continue
        sl = slice(h * G, (h + 1) * G)
        z = scale * (qt[sl] @ k.T)                          # (G, T, n)
        zmax = z.amax(dim=2, keepdim=True)
        e = torch.exp(z - zmax)
        den = e.sum(dim=2, keepdim=True)
        out[sl] = (e / den) @ v
        lse[sl] = (zmax + torch.log(den))[..., 0]
    return out.cpu().numpy(), lse.cpu().numpy()


class DeviceSphericalStore(SphericalStore):
    """``SphericalStore`` whose per-layer snapshots (the kept states' rotated code points
    s·ĉ, decoded once from the pages on the host) are float64 tensors on ``device``. The
    queries are rotated and the output rotated back and re-centred on the host, as the
    reference does: only the (G, T, d) queries and results cross. The sequence itself stays
    in the reference's ``SphericalKVCache`` (its pages, bytes and appends)."""

    def __init__(self, kv, seq: int, device="cuda"):
        import torch
        super().__init__(kv, seq)
        self.device = torch.device(device)

    def _snapshot(self, layer):
        if self._snap[layer] is None:
            host = super()._snapshot(layer)
            self._snap[layer] = [(_DeviceRows(k.rows, self.device), _DeviceRows(v.rows, self.device))
                                 for k, v in host]
        return self._snap[layer]

    def _softmax(self, q, k, v, scale):
        return _attend(self.device, [(k.rows, v.rows)], q, scale)
