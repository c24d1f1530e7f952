"""The evaluation's dense context stores on a torch device (``--device cuda``): the
baselines' kept or quantized states and the dense reference's exact states, held where the
model runs. ``DeviceDenseStore`` is the GPU twin of the reference's ``DenseStore``
(``spherical_kv_ref.hf_store``): the same checks, attention and appends, in float64, tested
equal to it (``tests/test_evaluate_device.py``)."""
from __future__ import annotations

import numpy as np

from spherical_kv_ref.hf_store import DenseStore


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
        import torch
        G = self.num_q_heads // self.num_kv_heads
        qt = torch.as_tensor(np.asarray(q, np.float64)).to(self.device)
        out = torch.zeros(qt.shape, dtype=torch.float64, device=self.device)
        lse = torch.full(qt.shape[:2], -np.inf, dtype=torch.float64, device=self.device)
        for h in range(self.num_kv_heads):
            k, v = self.keys[layer][h].rows, self.values[layer][h].rows
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
