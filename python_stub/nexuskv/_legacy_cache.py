"""TEMPORARY (until nexuskv.cache.make_cache lands from the cache branch): make_cache's
keywords on the old positional TorchBind constructor.  No eviction; a window or a
soft-cap is attended exactly over the dequantized cache."""

import torch


class LegacyCache:
    def __init__(self, window=None, external_chunk=0, **kw):
        self.window = window
        if external_chunk:
            self.c = torch.classes.nexuskv.KVCache(0, 1, -2, 0, False, 0, 1, -1, 0, kw["residual"], False, 0,
                                                   kw["sinks"], external_chunk)
        else:
            self.c = torch.classes.nexuskv.KVCache(kw["key_bits"], kw["key_group_size"], kw["key_axis"],
                                                   kw["key_outliers"], kw["key_dynamic"], kw["value_bits"],
                                                   kw["value_group_size"], kw["value_axis"], kw["value_outliers"],
                                                   kw["residual"], kw["rotate"], kw["seed"], kw["sinks"], 0,
                                                   kw["meta_dtype"])

    def __getattr__(self, name):
        return getattr(self.c, name)

    def evicted_lengths(self):
        return torch.zeros_like(self.c.lengths())

    def attend(self, q, scale, softcap):
        if self.window is None and softcap is None:
            return self.c.attend(q, scale)
        K, V, lens = self.c.dense(None)
        B, Hq, Lq, D = q.shape
        Lk = K.shape[-2]
        g = Hq // K.shape[1]
        s = torch.matmul(q.float(), K.repeat_interleave(g, 1).float().transpose(-1, -2)) * (scale or D ** -0.5)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        j = torch.arange(Lk)
        pos = lens.view(B, 1, 1) - Lq + torch.arange(Lq).view(1, Lq, 1)  # [B, Lq, 1]
        keep = (j.view(1, 1, Lk) <= pos) & (j.view(1, 1, Lk) < lens.view(B, 1, 1))
        if self.window is not None:
            keep &= j.view(1, 1, Lk) > pos - self.window
        s = s.masked_fill(~keep[:, None], float("-inf"))
        return torch.matmul(torch.softmax(s, -1), V.repeat_interleave(g, 1).float()).to(q.dtype)
