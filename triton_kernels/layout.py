"""The quantized format and the qgZ partition layout: sizes, dtypes and slot order.

Nothing here touches tensor data; both the torch references and the Triton launchers take their
sizes from these functions, so the two paths cannot disagree about a shape.

Blockwise format (ZeRO++ §3.1, Wang et al. 2023, arXiv:2306.10209): a row of ``numel`` values is cut
into ``ceil(numel / block)`` consecutive blocks (the last one, the *tail*, may be shorter), each with
one fp32 scale. INT8 stores one int8 code per value; INT4 stores two codes per uint8 byte (value
``2i`` in the low nibble, ``2i + 1`` in the high nibble, two's complement), an odd count padded
with a zero code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Largest code magnitude per bit width; codes lie in ``[-qmax, qmax]`` (symmetric, so -128 and
#: -8 are never produced and a code's sign always matches its value's sign).
QMAX: dict[int, int] = {8: 127, 4: 7}
MIN_BLOCK = 64
MAX_BLOCK = 4096


def check_bits(bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is 4 or 8."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits!r} is not supported: use bits=8 (int8 codes) or bits=4 (two codes per byte)")


def check_block(block: int) -> None:
    """Raise ``ValueError`` unless ``block`` is a power of two in [64, 4096].

    A power of two because a Triton tile's extent must be one; the range because below 64 the fp32
    scales cost more than 6% of an INT8 payload and above 4096 the error approaches per-tensor.
    """
    if (
        not isinstance(block, int)
        or isinstance(block, bool)
        or not MIN_BLOCK <= block <= MAX_BLOCK
        or block & (block - 1)
    ):
        raise ValueError(
            f"block={block!r} is not supported: use a power of two from {MIN_BLOCK} to {MAX_BLOCK} (e.g. 256)"
        )


def code_dtype(bits: int) -> torch.dtype:
    """The dtype of the code tensor: ``torch.int8`` for INT8, ``torch.uint8`` (packed pairs) for INT4."""
    check_bits(bits)
    return torch.int8 if bits == 8 else torch.uint8


def code_cols(numel: int, bits: int) -> int:
    """Bytes of codes for a row of ``numel`` values: ``numel`` for INT8, ``ceil(numel / 2)`` for INT4."""
    check_bits(bits)
    return numel if bits == 8 else (numel + 1) // 2


def num_blocks(numel: int, block: int) -> int:
    """Scales for a row of ``numel`` values: ``ceil(numel / block)`` (the tail block counts as one)."""
    return -(-numel // block)


@dataclass(frozen=True)
class QgzLayout:
    """How qgZ cuts a flat gradient into per-rank partitions and orders them (ZeRO++ §3.3).

    With ``W = nodes * ranks_per_node`` ranks, global rank ``r = node * ranks_per_node + local``
    owns the flat gradient's elements ``[r * part_numel, (r + 1) * part_numel)`` (the engine's
    shard; elements past ``numel`` count as zeros). Each partition is quantized on its own into
    ``part_len`` code slots (``part_numel`` rounded up to whole blocks, the extra slots zero), so a
    block never straddles two partitions and every partition has the same code and scale sizes.

    Partitions are stored in *slot* order for the intra-node all-to-all: slot
    ``j = local * nodes + node`` holds rank ``node * ranks_per_node + local``'s partition, i.e. a
    ``[node][local] -> [local][node]`` transpose (2 nodes x 4 ranks: ranks 0,4,1,5,2,6,3,7). Slots
    ``[k * nodes, (k + 1) * nodes)`` are the ones local peer ``k`` receives, contiguous.

    The tensors of one qgZ reduction (``C = code_cols``, ``P = blocks_per_part``, ``N = nodes``,
    ``D = ranks_per_node``):

    1. ``reorder_quantize(flat)``: codes ``[W, C]``, scales ``[W, P]``, rows in slot order.
    2. Intra-node all-to-all: send rows ``[k*N, (k+1)*N)`` to local peer ``k``; receive
       ``[D, N, C]`` codes and ``[D, N, P]`` scales (one ``[N, ...]`` group per local peer).
    3. ``dequantize_reduce_requantize``: sum over the ``D`` peers -> codes ``[N, C]``, scales
       ``[N, P]``; row ``m`` is the node-partial sum for rank ``m * D + local``.
    4. Inter-node all-to-all (ranks with the same ``local``): send row ``m`` to node ``m``;
       receive ``[N, C]`` codes and ``[N, P]`` scales, one row per node.
    5. ``dequantize_reduce(..., multiplier=1 / W)``: sum over the ``N`` nodes -> this rank's mean
       partition, ``[part_numel]`` in the requested dtype (what a mean reduce-scatter gives).

    Attributes:
        numel: Elements of the flat gradient.
        nodes: Number of nodes ``N`` (>= 1).
        ranks_per_node: Ranks per node ``D`` (>= 1).
        bits: 4 (as in ZeRO++'s qgZ) or 8.
        block: Elements per scale, a power of two in [64, 4096].
        part_numel: Elements each rank owns; defaults to ``ceil(numel / W)`` (the engine's
            ``shard_numel``). Must satisfy ``W * part_numel >= numel``.

    Raises:
        ValueError: On a non-positive size or topology, unsupported ``bits``/``block``, or a
            ``part_numel`` too small to cover ``numel``.
    """

    numel: int
    nodes: int
    ranks_per_node: int
    bits: int = 4
    block: int = 256
    part_numel: int = field(default=-1)

    def __post_init__(self) -> None:
        for name in ("numel", "nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"QgzLayout.{name}={value!r}: must be a positive integer")
        check_bits(self.bits)
        check_block(self.block)
        world = self.nodes * self.ranks_per_node
        if self.part_numel == -1:
            object.__setattr__(self, "part_numel", -(-self.numel // world))
        if not isinstance(self.part_numel, int) or self.part_numel * world < self.numel:
            raise ValueError(
                f"QgzLayout.part_numel={self.part_numel!r} leaves elements of a {self.numel}-element gradient"
                f" without an owner on {world} ranks: use part_numel >= ceil(numel / world) = {-(-self.numel // world)}"
                " (or leave it out)"
            )

    @property
    def world(self) -> int:
        """``W = nodes * ranks_per_node``."""
        return self.nodes * self.ranks_per_node

    @property
    def part_len(self) -> int:
        """Code slots per partition: ``part_numel`` rounded up to a multiple of ``block``."""
        return num_blocks(self.part_numel, self.block) * self.block

    @property
    def blocks_per_part(self) -> int:
        """Scales per partition, ``P = part_len / block``."""
        return self.part_len // self.block

    @property
    def code_cols(self) -> int:
        """Code bytes per partition, ``C``: ``part_len`` (INT8) or ``part_len / 2`` (INT4)."""
        return code_cols(self.part_len, self.bits)

    def rank_of_slot(self, slot: int) -> int:
        """The global rank whose partition sits at ``slot`` of the reordered layout."""
        node, local = slot % self.nodes, slot // self.nodes
        return node * self.ranks_per_node + local

    def slot_of_rank(self, rank: int) -> int:
        """Where global ``rank``'s partition sits in the reordered layout."""
        node, local = divmod(rank, self.ranks_per_node)
        return local * self.nodes + node

    def slot_order(self) -> list[int]:
        """Global ranks in slot order (2 nodes x 4: ``[0, 4, 1, 5, 2, 6, 3, 7]``)."""
        return [self.rank_of_slot(j) for j in range(self.world)]

    def packed(self) -> PackedRows:
        """The :class:`PackedRows` of one partition's codes and scales (what qgZ's legs send)."""
        return PackedRows(self.code_cols, self.blocks_per_part, self.bits)


#: Alignment of every part of a packed row: 16 bytes, so the kernels' 16-byte vector accesses to
#: the codes stay provably aligned in every row, and the scales can be viewed as fp32.
PACK_ALIGN = 16


@dataclass(frozen=True)
class PackedRows:
    """Rows of blockwise codes and their fp32 scales in one uint8 buffer, so a collective moves
    both in one call (ZeRO++'s qwZ gather §3.1 and qgZ's all-to-all legs §3.3 send each row's codes
    with its scales).

    A row of a ``[R, row_bytes]`` uint8 buffer holds ``code_bytes`` bytes of codes at offset 0,
    zero or more bytes of padding, ``scales`` fp32 scales (native byte order) at ``scale_offset``,
    then padding to ``row_bytes``. Both offsets and ``row_bytes`` are multiples of
    :data:`PACK_ALIGN`; the padding is sent with the row (it is at most 30 bytes per row).
    :meth:`views` gives the codes ``[R, code_bytes]`` and scales ``[R, scales]`` as views of the
    buffer (rows strided by ``row_bytes``), which the kernels read and write in place.

    Attributes:
        code_bytes: Bytes of codes per row (``code_cols(numel, bits)``).
        scales: fp32 scales per row (``ceil(numel / block)``).
        bits: The codes' width, 8 or 4 (their dtype, :func:`code_dtype`).
    """

    code_bytes: int
    scales: int
    bits: int

    @staticmethod
    def of(numel: int, bits: int, block: int) -> PackedRows:
        """The packed rows of ``numel`` values quantized with ``bits`` and ``block``."""
        return PackedRows(code_cols(numel, bits), num_blocks(numel, block), bits)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales in a row: ``code_bytes`` rounded up to :data:`PACK_ALIGN`."""
        return -(-self.code_bytes // PACK_ALIGN) * PACK_ALIGN

    @property
    def row_bytes(self) -> int:
        """Bytes per row, padding included: what a collective moves per row."""
        return -(-(self.scale_offset + 4 * self.scales) // PACK_ALIGN) * PACK_ALIGN

    def empty(self, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised ``[rows, row_bytes]`` uint8 buffer on ``device``."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (``code_dtype(bits)``, ``[..., code_bytes]``) and fp32 scales (``[..., scales]``)
        of ``buf``, a contiguous uint8 ``[..., row_bytes]`` buffer, as views sharing its memory.

        Raises:
            ValueError: ``buf`` is not a contiguous uint8 tensor of rows of ``row_bytes``.
        """
        if buf.dtype != torch.uint8 or buf.dim() < 1 or buf.shape[-1] != self.row_bytes or not buf.is_contiguous():
            raise ValueError(f"packed rows: got a {buf.dtype} {tuple(buf.shape)} tensor; pass a contiguous uint8 "
                             f"[..., {self.row_bytes}] buffer (PackedRows.empty)")
        codes = buf[..., : self.code_bytes].view(code_dtype(self.bits))
        # Byte offsets and row strides are multiples of 4 (of 16): a valid fp32 view.
        scales = buf[..., self.scale_offset : self.scale_offset + 4 * self.scales].view(torch.float32)
        return codes, scales
