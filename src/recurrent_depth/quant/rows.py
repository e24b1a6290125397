"""Codes as cache rows: one uint8 row per vector, every field's bytes end to end.

A quantized KV cache keeps one row of `bytes_per_vector` bytes per (batch row, head, token), so the
storage is a plain uint8 tensor that slices, gathers and grows like a float one. `row_codec(q)`
returns the codec for a quantizer:

- `RowCodec`: any quantizer; rows hold its `Codes` fields in order, and every read goes through
  the quantizer's own `decode` / `score` / `combine`.
- `TurboRows`: TurboQuant_mse and TurboQuant_prod, integer bits or a channel split, in a handful of
  kernels per call: the groups' rotations form one block-diagonal (permuted) matrix, their sketches
  another, all index and sign bits are packed by one gather and unpacked by one byte-table lookup.
  Decoding at batch 1 is bound by the number of tensor operations, not arithmetic, and the
  per-group quantizers cost ~30 operations per group per call. The row holds the same fields with
  the same byte sizes (`bytes_per_vector` of the quantizer; the bits are laid out group after
  group), and decodes to the quantizer's values up to float rounding (tests; a coordinate within
  rounding of a codebook boundary may take the neighbouring centroid).

Both give `encode(x) -> rows`, `decode(rows, dtype)`, `score(q, rows)` (q full precision) and
`combine(weights, rows)` (attention's value read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.quant.base import Quantizer, store_norm
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import packed_nbytes
from recurrent_depth.quant.split import ChannelSplit
from recurrent_depth.quant.turboquant import TurboQuantMSE, TurboQuantProd


class RowCodec:
    """Any quantizer's `Codes` as one uint8 row per vector: the fields' bytes end to end."""

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        probe = quantizer.encode(torch.zeros(1, quantizer.dim))
        self.layout = [(name, t.dtype, t.shape[-1] * t.element_size()) for name, t in probe.fields.items()]
        self.widths = [width for _, _, width in self.layout]
        self.nbytes = sum(self.widths)
        assert self.nbytes == quantizer.bytes_per_vector, (self.nbytes, quantizer.bytes_per_vector)

    def encode(self, x: Tensor) -> Tensor:
        """[..., D] floats -> [..., nbytes] uint8."""
        codes = self.quantizer.encode(x)
        return torch.cat([codes.fields[name].contiguous().view(torch.uint8) for name, _, _ in self.layout], dim=-1)

    def codes(self, rows: Tensor) -> Codes:
        """[..., nbytes] uint8 rows (any slice of a storage) -> the quantizer's Codes."""
        fields = {}
        for (name, dtype, _), part in zip(self.layout, rows.split(self.widths, dim=-1), strict=True):
            fields[name] = part if dtype == torch.uint8 else part.contiguous().view(dtype)
        return Codes(self.quantizer.spec, self.quantizer.dim, fields)

    def decode(self, rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.quantizer.decode(self.codes(rows)).to(dtype)

    def score(self, q: Tensor, rows: Tensor) -> Tensor:
        return self.quantizer.score(q, self.codes(rows))

    def combine(self, weights: Tensor, rows: Tensor) -> Tensor:
        return self.quantizer.combine(weights, self.codes(rows))


def _bit_table(device: torch.device) -> Tensor:
    """[256, 8] float32: the bits of each byte, most significant first."""
    return ((torch.arange(256, device=device)[:, None] >> torch.arange(7, -1, -1, device=device)) & 1).float()


class TurboRows:
    """TurboQuant (mse or prod; one group, or the two groups of a channel split) on cache rows.

    Row layout: [index bits of each group][sign bits of each group (prod)] each group's field
    padded to a whole byte, then fp16 norms ‖x_g‖ and (prod) ‖x_g‖·‖r_g‖ per group.
    """

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        D = self.dim = quantizer.dim
        if isinstance(quantizer, ChannelSplit):
            groups = [(quantizer.outlier, quantizer.outlier_channels), (quantizer.regular, quantizer.regular_channels)]
        else:
            groups = [(quantizer, list(range(D)))]
        self.prod = isinstance(groups[0][0], TurboQuantProd)
        self.groups = G = len(groups)
        self.has_index = any(group.codebook is not None for group, _ in groups)
        cpu = torch.device("cpu")
        rotate, unrotate, sketch = torch.zeros(D, D), torch.zeros(D, D), torch.zeros(D, D)
        member, qjl_scale = torch.zeros(D, G), torch.zeros(D)  # member: rotated column -> its group
        tables: dict[str, Tensor] = {}
        self._bounds: list[tuple[slice, Tensor]] = []
        # Packed bits: each group's indices (MSB first) padded to a byte, then each group's signs.
        # sources[i] = (column of the [indices | signs | 0] vector, shift) of bit i; `fields` keeps
        # each group's (columns, index bits, first index bit, first sign bit) for unpacking by slices.
        sources: list[tuple[int, int]] = []
        zero = 2 * D
        self.fields: list[tuple[slice, int, int, int | None]] = []
        col = 0
        for g, (group, channels) in enumerate(groups):
            d = group.dim
            cols = slice(col, col + d)
            col += d
            eye = torch.eye(d)
            rotate[channels, cols] = group.rotation.forward(eye)  # x @ rotate = each group's Πx_g
            unrotate[cols, channels] = group.rotation.inverse(eye)
            member[cols, g] = 1
            if self.prod:
                sketch[cols, cols] = group.sketch(eye)
                qjl_scale[cols] = group.scale
            b = group.codebook.bits if group.codebook is not None else 0
            self.fields.append((cols, b, len(sources), None))
            if b:
                centroids, bounds = group.codebook._on(cpu)
                tables[f"centroids{g}"] = centroids
                tables[f"powers{b}"] = 2.0 ** torch.arange(b - 1, -1, -1)
                self._bounds.append((cols, bounds))
                sources += [(c, s) for c in range(cols.start, cols.stop) for s in range(b - 1, -1, -1)]
                sources += [(zero, 0)] * (8 * packed_nbytes(d * b, 1) - d * b)
            else:  # prod:1 stores no indices: its "centroid" is 0 and the residual the unit vector
                tables[f"centroids{g}"] = torch.zeros(1)
        if self.prod:
            for g, (cols, b, start, _) in enumerate(self.fields):
                d = cols.stop - cols.start
                self.fields[g] = (cols, b, start, len(sources))
                sources += [(D + c, 0) for c in range(cols.start, cols.stop)]
                sources += [(zero, 0)] * (8 * packed_nbytes(d, 1) - d)
        self.bit_bytes = len(sources) // 8
        src = torch.tensor(sources)
        offsets = torch.zeros(D, dtype=torch.long)  # column c's centroids start at offsets[c] in `centroids`
        for g, (cols, _, _, _) in enumerate(self.fields[1:], 1):
            offsets[cols] = offsets[self.fields[g - 1][0].start] + len(tables[f"centroids{g - 1}"])
        all_centroids = [tables[f"centroids{g}"] for g in range(G)]
        tables.update(
            rotate=rotate, unrotate=unrotate, sketch=sketch, sketch_t=sketch.T.contiguous(), member=member,
            spread=member.T.contiguous(), qjl_scale=qjl_scale, bit_col=src[:, 0], bit_shift=src[:, 1],
            byte_weights=2.0 ** torch.arange(7, -1, -1), bit_table=_bit_table(cpu), offsets=offsets,
            centroids=torch.cat(all_centroids),
        )
        bit_table = tables["bit_table"]
        tables["byte_signs"] = bit_table * 2 - 1  # [256, 8]: a byte of sign bits as ±1
        for g, (_, b, _, _) in enumerate(self.fields):
            if b and 8 % b == 0:  # [256, 8 / b]: the centroids a byte of b-bit indices holds
                idx = (bit_table.unflatten(-1, (8 // b, b)) @ tables[f"powers{b}"]).long()
                tables[f"byte_centroids{g}"] = tables[f"centroids{g}"][idx]
        self._tables = tables
        self.nbytes = self.bit_bytes + 2 * G * (2 if self.prod else 1)
        assert self.nbytes == quantizer.bytes_per_vector, (self.nbytes, quantizer.bytes_per_vector)
        self._on_device: dict[torch.device, dict[str, Tensor]] = {}
        self._bounds_on: dict[torch.device, list[tuple[slice, Tensor]]] = {}

    def _t(self, device: torch.device) -> dict[str, Tensor]:
        """The codec's tables on `device`, copied there once."""
        if device not in self._on_device:
            tables = {k: v.to(device) for k, v in self._tables.items()}
            self._on_device[device] = tables
            self._bounds_on[device] = [(cols, b.to(device)) for cols, b in self._bounds]
        return self._on_device[device]

    # ------------------------------------------------------------------ encode
    def encode(self, x: Tensor) -> Tensor:
        t = self._t(x.device)
        y = x.float() @ t["rotate"]  # [..., D] each group rotated, groups side by side
        norm = ((y * y) @ t["member"]).sqrt()  # [..., G]
        unit = y / (norm.clamp_min(torch.finfo(torch.float32).tiny) @ t["spread"])
        idx = torch.zeros(unit.shape, dtype=torch.long, device=unit.device)
        for cols, bounds in self._bounds_on[x.device]:
            idx[..., cols] = torch.bucketize(unit[..., cols].contiguous(), bounds)
        norms = [norm]
        if self.prod:  # 1-bit QJL of the residual, in the rotated basis (as TurboQuantProd)
            residual = unit - t["centroids"][idx + t["offsets"]] if self.has_index else unit
            signs = (residual @ t["sketch_t"] >= 0).long()
            norms.append(norm * ((residual * residual) @ t["member"]).sqrt())
        else:
            signs = torch.zeros_like(idx)
        stream = torch.cat([idx, signs, torch.zeros_like(idx[..., :1])], dim=-1)  # [indices | signs | 0]
        bits = stream[..., t["bit_col"]] >> t["bit_shift"] & 1  # [..., 8 bit_bytes]
        packed = (bits.unflatten(-1, (-1, 8)).float() @ t["byte_weights"]).to(torch.uint8)
        stored = store_norm(torch.cat(norms, dim=-1), "vector norm")
        return torch.cat([packed, stored.view(torch.uint8)], dim=-1)

    # ------------------------------------------------------------------ decode
    def _fields(self, rows: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None]:
        """(centroid values [..., D] or None, signs ±1 [..., D] or None, norm and residual norm per column).

        Each group's field is a byte range of the row; a width dividing 8 is read by one lookup of a
        [256, 8 / b] table of centroid values per byte, other widths through the bits of each byte."""
        t = self._t(rows.device)
        data = rows[..., : self.bit_bytes].long()
        norms = rows[..., self.bit_bytes:].contiguous().view(torch.float16).float()  # [..., G or 2G]
        values, signs = [], []
        for g, (cols, b, start, sign_start) in enumerate(self.fields):
            d = cols.stop - cols.start
            if b and 8 % b == 0:
                field = data[..., start // 8 : (start + d * b + 7) // 8]
                values.append(F.embedding(field, t[f"byte_centroids{g}"]).flatten(-2)[..., :d])
            elif b:
                field = data[..., start // 8 : (start + d * b + 7) // 8]
                bits = F.embedding(field, t["bit_table"]).flatten(-2)[..., : d * b]
                idx = bits.unflatten(-1, (d, b)) @ t[f"powers{b}"]
                values.append(t[f"centroids{g}"].index_select(0, idx.long().flatten()).view(idx.shape))
            else:
                values.append(norms.new_zeros(*norms.shape[:-1], d))
            if sign_start is not None:
                field = data[..., sign_start // 8 : (sign_start + d + 7) // 8]
                signs.append(F.embedding(field, t["byte_signs"]).flatten(-2)[..., :d])
        G = self.groups
        out_values = (values[0] if len(values) == 1 else torch.cat(values, dim=-1)) if self.has_index else None
        norm = norms[..., :G] @ t["spread"]
        if not self.prod:
            return out_values, None, norm, None
        sign = signs[0] if G == 1 else torch.cat(signs, dim=-1)
        return out_values, sign, norm, norms[..., G:] @ t["spread"]

    def _rotated(self, rows: Tensor) -> Tensor:
        t = self._t(rows.device)
        values, signs, norm, rnorm = self._fields(rows)
        out = values * norm if values is not None else 0
        if signs is not None:
            out = out + (t["qjl_scale"] * rnorm) * (signs @ t["sketch"])
        return out

    def decode(self, rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self._rotated(rows) @ self._t(rows.device)["unrotate"]).to(dtype)

    def score(self, q: Tensor, rows: Tensor) -> Tensor:
        """q [..., M, D] against rows [..., N, bytes] -> [..., M, N], no decoded key for the QJL part."""
        t = self._t(rows.device)
        qr = q.float() @ t["rotate"]
        values, signs, norm, rnorm = self._fields(rows)
        out = qr @ (values * norm).mT if values is not None else 0
        if signs is not None:
            out = out + (qr @ t["sketch_t"]) @ (signs * (t["qjl_scale"] * rnorm)).mT
        return out

    def combine(self, weights: Tensor, rows: Tensor) -> Tensor:
        return (weights.float() @ self._rotated(rows)) @ self._t(rows.device)["unrotate"]


def row_codec(quantizer: Quantizer) -> RowCodec | TurboRows:
    """The fastest row codec for a quantizer: `TurboRows` for TurboQuant, else `RowCodec`."""
    inner = quantizer.outlier if isinstance(quantizer, ChannelSplit) else quantizer
    if isinstance(inner, TurboQuantMSE | TurboQuantProd):
        return TurboRows(quantizer)
    return RowCodec(quantizer)

