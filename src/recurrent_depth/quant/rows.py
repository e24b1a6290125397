"""Codes as cache rows: one uint8 row per vector, every field's bytes end to end.

A quantized KV cache keeps one row of `bytes_per_vector` bytes per (batch row, head, token), so the
storage is a plain uint8 tensor that slices, gathers and grows like a float one. `row_codec(q)`
returns the codec for a quantizer:

- `RowCodec`: any quantizer; rows hold its `Codes` fields in order, and every read goes through
  the quantizer's own `decode` / `score` / `combine`.
- `TurboRows`: TurboQuant_mse and TurboQuant_prod, integer bits or a channel split, in a handful of
  kernels per call: the groups' rotations form one block-diagonal (permuted) matrix, their sketches
  another, all index and sign bits are packed by one gather, and reads cut each field's entries out
  of whole-byte words by shifts and masks (`turbo_entries`), with the rotations, sketches and QJL
  scales folded into two constant matrices. Decoding at batch 1 is bound by the number of tensor
  operations, not arithmetic, and the per-group quantizers cost ~30 operations per group per call.
  The work is done by plain functions of tensors (`turbo_encode`, `turbo_score`, ...), which
  `recurrent_depth.accel.quant` compiles for decoding; called eagerly they are the reference. The
  row holds the same fields with the same byte sizes (`bytes_per_vector` of the quantizer; the bits
  are laid out group after group), and decodes to the quantizer's values up to float rounding
  (tests; a coordinate within rounding of a codebook boundary may take the neighbouring centroid).

Both give `encode(x) -> rows`, `decode(rows, dtype)`, `score(q, rows)` (q full precision) and
`combine(weights, rows)` (attention's value read).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.quant.base import NORM_DTYPE, Quantizer, store_norm, stored_ratio
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import packed_nbytes
from recurrent_depth.quant.split import ChannelSplit
from recurrent_depth.quant.turboquant import TurboQuantMSE, TurboQuantProd, residual_code


def bytes_as(part: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 `[..., n]` (a slice of code rows) read as `dtype` `[..., n / size]`, through a contiguous
    copy: a row slice of a storage whose rows have an odd length (prod's residual byte, polar) can have
    strides or an offset the wider dtype cannot view even when torch calls it contiguous (one row of
    one KV head), and a slice of many rows is copied by `.contiguous()` anyway."""
    return part.clone(memory_format=torch.contiguous_format).view(dtype)


class RowCodec:
    """Any quantizer's `Codes` as one uint8 row per vector: the fields' bytes end to end."""

    _unperm: Tensor | None = None

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        probe = quantizer.encode(torch.zeros(1, quantizer.dim, dtype=torch.float32))
        self.layout = [(name, t.dtype, t.shape[-1] * t.element_size()) for name, t in probe.fields.items()]
        self.widths = [width for _, _, width in self.layout]
        self.nbytes = sum(self.widths)
        assert self.nbytes == quantizer.bytes_per_vector, (self.nbytes, quantizer.bytes_per_vector)

    perm: Tensor | None = None  # a per-head channel permutation applied first (`permuted`)

    def permuted(self, perm: Tensor) -> RowCodec:
        """This codec over `[..., Hkv, N, D]` with head h's channels permuted first: it codes
        x[..., perm[h]] (`perm` `[..., Hkv, D]`, leading axes broadcast against the data's) and reads
        back in the original order, as `TurboRows.permuted` (here one gather per call: a quantizer
        whose first channels are its outliers, e.g. QJL's, then keeps each head's calibrated ones)."""
        twin = copy.copy(self)
        twin.perm, twin._unperm = perm, perm.argsort(dim=-1)
        return twin

    @property
    def state_nbytes(self) -> int:
        """Per-cache state beyond the seed: one D-bit outlier mask per head of a permutation."""
        return 0 if self.perm is None else self.perm[..., 0].numel() * math.ceil(self.quantizer.dim / 8)

    def _gather(self, x: Tensor, order: Tensor | None) -> Tensor:
        """x `[..., Hkv, N, D]` with each head's channels taken in `order` `[..., Hkv, D]` (None: as is)."""
        if order is None:
            return x
        index = order.to(x.device)[..., None, :]
        shape = torch.broadcast_shapes(index.shape[:-2], x.shape[:-2])
        return x.expand(*shape, *x.shape[-2:]).gather(-1, index.expand(*shape, x.shape[-2], x.shape[-1]))

    def encode(self, x: Tensor) -> Tensor:
        """[..., D] floats -> [..., nbytes] uint8."""
        codes = self.quantizer.encode(self._gather(x, self.perm))
        return torch.cat([codes.fields[name].contiguous().view(torch.uint8) for name, _, _ in self.layout], dim=-1)

    def codes(self, rows: Tensor) -> Codes:
        """[..., nbytes] uint8 rows (any slice of a storage) -> the quantizer's Codes."""
        fields = {}
        for (name, dtype, _), part in zip(self.layout, rows.split(self.widths, dim=-1), strict=True):
            fields[name] = part if dtype == torch.uint8 else bytes_as(part, dtype)
        return Codes(self.quantizer.spec, self.quantizer.dim, fields, self.quantizer.state_key)

    def decode(self, rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        return self._gather(self.quantizer.decode(self.codes(rows)), self._unperm).to(dtype)

    def score(self, q: Tensor, rows: Tensor) -> Tensor:
        return self.quantizer.score(self._gather(q, self.perm), self.codes(rows))

    def combine(self, weights: Tensor, rows: Tensor) -> Tensor:
        return self._gather(self.quantizer.combine(weights, self.codes(rows)), self._unperm)


class TurboTables(NamedTuple):
    """A `TurboRows` codec's constants on one device, as the plain functions below take them."""

    rotate: Tensor  # [D, D]: x @ rotate = each group's Πx_g, groups side by side
    col_group: Tensor  # [D] long: each rotated column's group
    col_shift: Tensor  # [D]: 4 g for the columns of group g (one search for all groups)
    boundaries: Tensor  # every group's boundaries, shifted by 4 g, a separator before each group g > 0
    offsets: Tensor  # [D] long: where each column's group starts in `centroids`
    centroids: Tensor  # every group's centroids end to end
    sketch_t: Tensor | None  # [D, D] the groups' QJL sketches, transposed (prod), else None
    bit_col: Tensor  # [8 bit_bytes] long: the column of the [indices | signs | 0] stream of each packed bit
    bit_shift: Tensor  # [8 bit_bytes] long: which bit of that column
    bit_place: Tensor  # [8 bit_bytes] long: the place of each bit in its byte (most significant first)
    group_sizes: tuple[int, ...]  # the groups' sizes, side by side in the rotated basis
    # entry fields: (first byte, count, bits, offset of its centroids or None for sign bits, norm)
    fields: tuple[tuple[int, int, int, int | None, int], ...]
    field_shifts: tuple[Tensor, ...]  # [entries per word] int per field: each entry's place in its word
    # eager reads, per field: [256, 8 / b] the values a byte holds (b = 1, 2, 4, 8), else [b] the bits' weights
    byte_tables: tuple[Tensor, ...]
    bit_table: Tensor  # [256, 8] the bits of each byte, most significant first
    pad: int  # zero bytes appended to a row so that every field's last word is whole
    norm_bytes: int  # where the fp16 norms start in a row (then, for prod, one residual byte per group)
    residual_steps: tuple[float, ...]  # prod: each group's residual-norm grid step (`residual_code`), else ()
    residual_step: Tensor  # [G] the same as a tensor (decoding), empty for mse
    dither: tuple[Tensor, ...]  # prod: each group's stochastic-rounding hash weights, else ()
    query: Tensor  # [D, E]: q @ query gives q's weight on each entry (rotation, sketch and QJL scale)
    back: Tensor  # [E, D]: entries @ back is the decoded vector
    # A folded per-head channel permutation (`TurboRows.permuted`): perm [..., Hkv, D] long, and the
    # shared codec's query and back, of which `query` and `back` are its per-head row / column
    # permutations (q @ query = q[..., perm] @ base_query; x @ rotate = x[..., perm] @ base_rotate); None
    # without one.
    perm: Tensor | None = None
    base_query: Tensor | None = None
    base_back: Tensor | None = None
    base_rotate: Tensor | None = None


class TurboRows:
    """TurboQuant (mse or prod; one group, or the two groups of a channel split) on cache rows.

    Row layout: [index bits of each group][sign bits of each group (prod)] each group's field
    padded to a whole byte, then the fp16 norm ‖x_g‖ of each group, then (prod) each group's
    residual norm byte (`turboquant.residual_code`).

    `permuted(perm)` gives the same codec with each KV head's channels permuted first (calibrated
    outlier channels, `inference.quant_cache.layer_codec`), folded into its matrices.

    A row reads as E "entries" (D centroid indices, then, for prod, D sign bits): each entry's bits
    are cut out of the row in one vectorized step, looked up, scaled by its group's norm, and the
    rotations and sketches are folded into two constant matrices (`TurboTables.query`, `.back`), so
    that scores, decodes and value sums are a few operations whatever the number of groups.
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
        # (float32 tables whatever torch's default dtype: a bf16 default made them bf16, and encoding failed)
        zeros = functools.partial(torch.zeros, dtype=torch.float32)
        rotate, unrotate, sketch = zeros(D, D), zeros(D, D), zeros(D, D)
        member, qjl_scale = zeros(D, G), zeros(D)  # member: rotated column -> its group
        centroids: list[Tensor] = []
        boundaries: list[Tensor] = []
        # Packed bits: each group's indices (MSB first) padded to a byte, then each group's signs.
        # sources[i] = (column of the [indices | signs | 0] vector, shift) of bit i; `fields` keeps
        # each group's (columns, index bits, first index bit, first sign bit).
        sources: list[tuple[int, int]] = []
        zero = 2 * D if self.prod else D
        self.fields: list[tuple[slice, int, int, int | None]] = []
        col = 0
        for g, (group, channels) in enumerate(groups):
            d = group.dim
            cols = slice(col, col + d)
            col += d
            eye = torch.eye(d, dtype=torch.float32)
            rotate[channels, cols] = group.rotation.forward(eye)  # x @ rotate = each group's Πx_g
            unrotate[cols, channels] = group.rotation.inverse(eye)
            member[cols, g] = 1
            if self.prod:
                sketch[cols, cols] = group.sketch(eye)
                qjl_scale[cols] = group.scale
            b = group.codebook.bits if group.codebook is not None else 0
            self.fields.append((cols, b, len(sources), None))
            if g:  # a separator: the groups' searches do not overlap (see `turbo_encode`)
                boundaries.append(torch.tensor([4.0 * g - 2], dtype=torch.float32))
            if b:
                values, bounds = group.codebook._on(cpu)
                centroids.append(values)
                boundaries.append(bounds + 4.0 * g)
                sources += [(c, s) for c in range(cols.start, cols.stop) for s in range(b - 1, -1, -1)]
                sources += [(zero, 0)] * (8 * packed_nbytes(d * b, 1) - d * b)
            else:  # prod:1 stores no indices: its "centroid" is 0 and the residual the unit vector
                centroids.append(zeros(1))
        if self.prod:
            for g, (cols, b, start, _) in enumerate(self.fields):
                d = cols.stop - cols.start
                self.fields[g] = (cols, b, start, len(sources))
                sources += [(D + c, 0) for c in range(cols.start, cols.stop)]
                sources += [(zero, 0)] * (8 * packed_nbytes(d, 1) - d)
        self.bit_bytes = len(sources) // 8
        self.nbytes = self.bit_bytes + 2 * G + (G if self.prod else 0)  # fp16 norms, (prod) residual bytes
        self.perm: Tensor | None = None  # a per-head channel permutation folded in (`permuted`)
        assert self.nbytes == quantizer.bytes_per_vector, (self.nbytes, quantizer.bytes_per_vector)
        src = torch.tensor(sources)
        starts = torch.tensor([0] + [len(c) for c in centroids]).cumsum(0)
        col_group = member.argmax(dim=1)
        # Entry fields: each group's indices, then (prod) each group's signs (see `turbo_entries`).
        fields = [(start // 8, cols.stop - cols.start, b, int(starts[g]), g)
                  for g, (cols, b, start, _) in enumerate(self.fields)]
        if self.prod:
            fields += [(sign_start // 8, cols.stop - cols.start, 1, None, G + g)
                       for g, (cols, _, _, sign_start) in enumerate(self.fields)]
        shifts, byte_tables, pad = [], [], 0
        byte_bits = ((torch.arange(256)[:, None] >> torch.arange(7, -1, -1)) & 1)  # [256, 8] most significant first
        for first, count, bits, offset, _ in fields:
            table = weights = 2.0 ** torch.arange(bits - 1, -1, -1, dtype=torch.float32)
            if bits and 8 % bits == 0:
                index = (byte_bits.unflatten(-1, (8 // bits, bits)).float() @ weights).long()
                table = (index * 2 - 1).float() if offset is None else torch.cat(centroids)[index + offset]
            byte_tables.append(table)
            word_bytes, per_word = _word(max(bits, 1))
            word_dtype = torch.int32 if word_bytes <= 3 else torch.long  # (int32: twice the vector lanes)
            shifts.append(torch.arange(per_word - 1, -1, -1, dtype=word_dtype) * bits)
            pad = max(pad, first + -(-count // per_word) * word_bytes - self.nbytes)
        sketch_t = sketch.T.contiguous()
        query, back = rotate, unrotate
        if self.prod:
            query = torch.cat([rotate, (rotate @ sketch_t) * qjl_scale], dim=1)
            back = torch.cat([unrotate, (qjl_scale[:, None] * sketch) @ unrotate])
        all_centroids = torch.cat(centroids)
        self._tables = TurboTables(
            rotate=rotate, col_group=col_group, col_shift=4.0 * col_group.float(),
            boundaries=torch.cat(boundaries) if boundaries else zeros(0),
            offsets=starts[col_group], centroids=all_centroids, sketch_t=sketch_t if self.prod else None,
            bit_col=src[:, 0], bit_shift=src[:, 1], bit_place=7 - torch.arange(len(sources)) % 8,
            group_sizes=tuple(group.dim for group, _ in groups),
            fields=tuple(fields), field_shifts=tuple(shifts), byte_tables=tuple(byte_tables), pad=pad,
            bit_table=byte_bits.float(),
            norm_bytes=self.bit_bytes, query=query.contiguous(), back=back.contiguous(),
            residual_steps=tuple(group.residual_step for group, _ in groups) if self.prod else (),
            residual_step=torch.tensor([group.residual_step for group, _ in groups] if self.prod else [],
                                       dtype=torch.float32),
            dither=tuple(group.dither(rotate) for group, _ in groups) if self.prod else (),
        )
        self._on_device: dict[torch.device, TurboTables] = {cpu: self._tables}

    def permuted(self, perm: Tensor) -> TurboRows:
        """This codec over `[..., Hkv, N, D]` with head h's channels permuted first: it codes
        x[..., perm[h]] (`perm` `[..., Hkv, D]`, leading axes broadcast against the data's), and reads
        back in the original order. x[..., perm] @ R = x @ R[perm⁻¹], so the permutation folds into
        the rotation and query matrices (rows) and the back matrix (columns), one per head, which the
        same functions broadcast over the heads: no extra operation per call."""
        t = self._tables
        if t.perm is not None:  # its matrices are per head already: permute the shared codec once instead
            raise ValueError("permuted: this codec is permuted already; permute the shared codec with the composed "
                             "permutation")
        twin = copy.copy(self)
        unperm = perm.argsort(dim=-1).cpu()
        # (base_*: the shared matrices, for kernels that permute q and the output instead)
        twin._tables = t._replace(rotate=t.rotate[unperm].contiguous(), query=t.query[unperm].contiguous(),
                                  back=t.back.T[unperm].transpose(-1, -2).contiguous(), perm=perm.cpu(),
                                  base_query=t.query, base_back=t.back, base_rotate=t.rotate)
        twin._on_device = {torch.device("cpu"): twin._tables}
        twin.perm = perm
        return twin

    @property
    def state_nbytes(self) -> int:
        """Per-cache state beyond the seed: one D-bit outlier mask per head of a folded permutation."""
        return 0 if self.perm is None else self.perm[..., 0].numel() * math.ceil(self.dim / 8)

    def tables(self, device: torch.device) -> TurboTables:
        """The codec's constants on `device`, copied there once."""
        tables = self._on_device.get(device)
        if tables is None:
            tables = self._on_device[device] = TurboTables(
                *(_to(v, device) for v in self._tables))
        return tables

    # ------------------------------------------------------------------ encode
    def encode(self, x: Tensor) -> Tensor:
        rows, finite = turbo_encode(x, self.tables(x.device))
        check_stored_norms(finite, x)
        return rows

    # ------------------------------------------------------------------ decode
    def decode(self, rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        return turbo_decode(rows, self.tables(rows.device)).to(dtype)

    def score(self, q: Tensor, rows: Tensor) -> Tensor:
        """q [..., M, D] against rows [..., N, bytes] -> [..., M, N], no decoded key for the QJL part."""
        return turbo_score(q, rows, self.tables(rows.device))

    def combine(self, weights: Tensor, rows: Tensor) -> Tensor:
        return turbo_combine(weights, rows, self.tables(rows.device))


def check_stored_norms(finite: Tensor, x: Tensor) -> None:
    """`store_norm`'s refusal for a fused encode, which returns whether every stored norm is finite."""
    if not bool(finite):
        store_norm(x.float().norm(dim=-1, keepdim=True), "vector norm")  # raises, naming the largest


# Plain functions of tensors (no Python state), so that `recurrent_depth.accel.quant` can compile them
# once for every codec; `TurboRows` calls them eagerly, which is the reference.
def turbo_encode(x: Tensor, t: TurboTables) -> tuple[Tensor, Tensor]:
    """[..., D] floats -> ([..., nbytes] uint8 rows, whether every stored norm is finite)."""
    y = x.float() @ t.rotate  # [..., D] each group rotated, groups side by side
    norm = _group_norms(y, t)  # [..., G]
    unit = y / norm.clamp_min(torch.finfo(torch.float32).tiny).index_select(-1, t.col_group)
    # One search for every group: group g's coordinates and boundaries are shifted apart by 4 g, with
    # a separator between groups, so the result is each coordinate's index into `t.centroids`.
    where = torch.bucketize(unit + t.col_shift, t.boundaries)
    stream = [where - t.offsets]
    stored = norm.to(NORM_DTYPE)
    residual_bytes = []
    if t.sketch_t is not None:  # prod: 1-bit QJL of the residual, in the rotated basis (as TurboQuantProd)
        ratio = stored_ratio(norm, stored).index_select(-1, t.col_group)  # Πx / n, n the stored norm
        residual = unit * ratio - t.centroids[where]
        signs = (residual @ t.sketch_t >= 0).long()
        stream.append(signs)
        rnorm = _group_norms(residual, t)
        residual_bytes = [residual_code(rnorm[..., g : g + 1], part, weights, step) for g, (part, weights, step)
                          in enumerate(zip(signs.split(t.group_sizes, dim=-1), t.dither, t.residual_steps,
                                           strict=True))]
    stream.append(torch.zeros_like(where[..., :1]))
    bits = ((torch.cat(stream, dim=-1).index_select(-1, t.bit_col) >> t.bit_shift) & 1) << t.bit_place
    packed = bits.unflatten(-1, (-1, 8)).sum(-1).to(torch.uint8)
    rows = torch.cat([packed, stored.view(torch.uint8), *residual_bytes], dim=-1)
    return rows, torch.isfinite(stored).all()


def _group_norms(y: Tensor, t: TurboTables) -> Tensor:
    """[..., D] rotated vectors -> [..., G] each group's norm (the groups are side by side)."""
    if len(t.group_sizes) == 1:
        return torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    return torch.stack([torch.linalg.vector_norm(part, dim=-1) for part in y.split(t.group_sizes, dim=-1)], dim=-1)


def turbo_entries(rows: Tensor, t: TurboTables) -> Tensor:
    """[..., N, bytes] rows -> [..., N, E] each entry's share of the rotated vector: the index
    entries' centroid times the group's norm, then (prod) the sign entries' ±1 times the group's
    residual norm, so that the vector in the rotated basis is `entries @ t.back` (decode) and
    ⟨q, vector⟩ is `(q @ t.query) · entries` (score).

    A field of b-bit entries is read in words of lcm(b, 8) bits (one byte for b = 1, 2, 4, 8; three
    for b = 3), big-endian, each entry shifted and masked out of its word: no per-entry gather."""
    G = len(t.group_sizes)
    norms = bytes_as(rows[..., t.norm_bytes : t.norm_bytes + 2 * G], NORM_DTYPE).float()  # [..., G]
    if t.residual_steps:  # prod: then each group's n·ρ, ρ its residual byte times the group's step
        residual = rows[..., t.norm_bytes + 2 * G : t.norm_bytes + 3 * G].float() * t.residual_step
        norms = torch.cat([norms, norms * residual], dim=-1)  # [..., 2G]
    if t.pad:
        rows = F.pad(rows, (0, t.pad))
    parts = []
    eager = not torch.compiler.is_compiling()
    for (first, count, bits, offset, norm), shifts, table in zip(t.fields, t.field_shifts, t.byte_tables,
                                                                 strict=True):
        if not bits:  # prod:1 stores no indices: its centroid is 0
            parts.append(norms.new_zeros(*norms.shape[:-1], count))
            continue
        if eager:  # fewer, larger operations eagerly: one lookup per byte
            field = rows[..., first: first + -(-count * bits // 8)].long()
            if table.shape[0] == 256:  # a width dividing 8: the values each byte holds
                value = F.embedding(field, table).flatten(-2)[..., :count]
            else:  # the bits of each byte, then each index from its bits (`table`: their weights)
                index = F.embedding(field, t.bit_table).flatten(-2)[..., : count * bits].unflatten(-1, (count, bits))
                value = t.centroids[(index @ table).long() + offset]
            parts.append(value * norms[..., norm: norm + 1])
            continue
        word_bytes, per_word = _word(bits)
        words = -(-count // per_word)
        chunk = rows[..., first: first + words * word_bytes].to(shifts.dtype)
        if word_bytes > 1:
            chunk = chunk.unflatten(-1, (words, word_bytes))
            word = chunk[..., 0]
            for i in range(1, word_bytes):
                word = (word << 8) | chunk[..., i]
        else:
            word = chunk
        index = ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]
        value = index * 2.0 - 1 if offset is None else t.centroids[index + offset]  # (None: sign bits)
        parts.append(value * norms[..., norm: norm + 1])
    return torch.cat(parts, dim=-1)


def _word(bits: int) -> tuple[int, int]:
    """(bytes, entries) of the smallest whole-byte word of b-bit entries."""
    word_bits = math.lcm(bits, 8)
    return word_bits // 8, word_bits // bits


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(_to(v, device) for v in value) if isinstance(value, tuple) else value


def turbo_decode(rows: Tensor, t: TurboTables) -> Tensor:
    return turbo_entries(rows, t) @ t.back


def turbo_score(q: Tensor, rows: Tensor, t: TurboTables) -> Tensor:
    return (q.float() @ t.query) @ turbo_entries(rows, t).mT


def turbo_combine(weights: Tensor, rows: Tensor, t: TurboTables) -> Tensor:
    return (weights.float() @ turbo_entries(rows, t)) @ t.back


def row_codec(quantizer: Quantizer) -> RowCodec | TurboRows:
    """The fastest row codec for a quantizer: `TurboRows` for TurboQuant, else `RowCodec`."""
    inner = quantizer.outlier if isinstance(quantizer, ChannelSplit) else quantizer
    if isinstance(inner, TurboQuantMSE | TurboQuantProd):
        return TurboRows(quantizer)
    return RowCodec(quantizer)

