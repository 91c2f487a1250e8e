"""engine/layers/cpu_attention: the CPU's deterministic paged attention kernel (C, built here).

Close to a float64 reference, and a row's bits the same whatever the batch beside it, however its
prompt is split into prefill chunks and decode steps, the block size and the threads."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.layers import cpu_attention, cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler builds cpu_attention.c")

PS = 16  # tokens a page


def _pool(slots: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(slots, heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _table(requests: int, pages: int, total: int) -> torch.Tensor:
    """Each request's pages: distinct, shuffled, never page 0."""
    perm = torch.randperm(total - 1, generator=torch.Generator().manual_seed(7))[: requests * pages] + 1
    return perm.view(requests, pages).to(torch.int32)


def _attend(q: torch.Tensor, table: torch.Tensor, seqs: list[int], lens: list[int], k: torch.Tensor, v: torch.Tensor,
            tokens: int | None = None, threads: int | None = None, dv: int | None = None,
            scale: float | None = None) -> torch.Tensor:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        p = cpu_attention.plan(table, seqs, lens, k.shape[1], q.shape[1] // k.shape[1], tokens)
        return cpu_attention.attend(q, p, k, v, PS, q.shape[-1] ** -0.5 if scale is None else scale, dv)
    finally:
        torch.set_num_threads(before)


def _reference(q: torch.Tensor, table: torch.Tensor, seqs: list[int], lens: list[int], k: torch.Tensor,
               v: torch.Tensor, dv: int, scale: float) -> torch.Tensor:
    """Causal attention in float64 over each request's gathered slots."""
    out, row = [], 0
    g = q.shape[1] // k.shape[1]
    for r, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
        pos = torch.arange(seq)
        slots = table[r, pos // PS].long() * PS + pos % PS
        kk = k[slots].double().repeat_interleave(g, 1)
        vv = v[slots][..., :dv].double().repeat_interleave(g, 1)
        s = torch.einsum("thd,khd->htk", q[row : row + n].double(), kk) * scale
        s.masked_fill_(pos[None, None, :] > torch.arange(seq - n, seq)[None, :, None], float("-inf"))
        out.append(torch.einsum("htk,khd->thd", s.softmax(-1), vv))
        row += n
    return torch.cat(out)


# (KV dtype, q dtype): bf16 queries over bf16 keys take the bf16 pairs path where the CPU has a unit for it
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), DTYPES)
def test_close_to_float64(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    seqs, lens = [150, 1, 70, 64], [150, 1, 23, 1]  # fresh, a one-token prompt, behind a prefix, a decode
    k, v = _pool(64 * PS, 3, 64, kv_dtype, 1), _pool(64 * PS, 3, 64, kv_dtype, 2)
    table = _table(4, 10, 64)
    q = torch.randn(sum(lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    got = _attend(q, table, seqs, lens, k, v)
    want = _reference(q, table, seqs, lens, k, v, 64, 64**-0.5)
    assert got.dtype == torch.float32 and got.shape == (sum(lens), 9, 64)
    # the pairs path (bf16 queries) splits the probabilities into bf16 hi + lo: 2^-16 of each term, two
    # orders below the bf16 rounding its caller applies to the output
    tol = {"rtol": 1e-4, "atol": 2e-5} if q_dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), DTYPES)
def test_lse_is_each_rows_logsumexp(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    """The kernel's LSE output (context parallelism merges partials by it): each row's log-sum-exp
    of its scaled causal scores, close to float64, and asking for it leaves the output's bits alone."""
    seqs, lens = [150, 70, 64], [150, 23, 1]
    k, v = _pool(64 * PS, 3, 64, kv_dtype, 1), _pool(64 * PS, 3, 64, kv_dtype, 2)
    table = _table(3, 10, 64)
    q = torch.randn(sum(lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    p = cpu_attention.plan(table, seqs, lens, 3, 3)
    lse = torch.full((sum(lens), 9), float("nan"))
    got = cpu_attention.attend(q, p, k, v, PS, 0.125, lse=lse)
    assert torch.equal(got, cpu_attention.attend(q, p, k, v, PS, 0.125))
    want, row = [], 0
    for r, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
        pos = torch.arange(seq)
        kk = k[table[r, pos // PS].long() * PS + pos % PS].double().repeat_interleave(3, 1)
        sc = torch.einsum("thd,khd->thk", q[row : row + n].double(), kk) * 0.125
        sc.masked_fill_(pos[None, None, :] > torch.arange(seq - n, seq)[:, None, None], float("-inf"))
        want.append(sc.logsumexp(-1))
        row += n
    torch.testing.assert_close(lse.double(), torch.cat(want), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="lse must be float32"):
        cpu_attention.attend(q, p, k, v, PS, 0.125, lse=torch.empty(sum(lens), 8))


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (9, 3), (4, 2), (3, 3)])
def test_a_row_has_its_bits_in_any_split(kv_dtype: torch.dtype, q_dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """A 200-token prompt's rows: prefilled whole, in chunks of 37 behind its own prefix, a token
    at a time (decode), beside other requests, in blocks of 1, 3 or 64 tokens (GQA groups of 4
    and of 3: blocks of an odd number of rows too; of 2 and 1: a decode item of every row count up to
    4, which AVX512-BF16 computes without packed operands), on 1 or 2 threads."""
    n, others = 200, [(90, 90), (300, 5), (17, 1)]
    hq, hkv = heads
    k, v = _pool(128 * PS, hkv, 32, kv_dtype, 4), _pool(128 * PS, hkv, 32, kv_dtype, 5)
    table = _table(1 + len(others), 19, 128)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(n, hq, 32, generator=gen).to(q_dtype)
    whole = _attend(q, table, [n], [n], k, v, threads=1)

    chunks = [_attend(q[s : s + 37], table, [min(n, s + 37)], [min(37, n - s)], k, v) for s in range(0, n, 37)]
    assert torch.equal(torch.cat(chunks), whole)

    steps = [_attend(q[t : t + 1], table, [t + 1], [1], k, v, tokens=1) for t in range(150, n)]
    assert torch.equal(torch.cat(steps), whole[150:])

    extra = [torch.randn(m, hq, 32, generator=gen).to(q_dtype) for _, m in others]
    q_mixed = torch.cat([extra[0], q[120:], *extra[1:]])
    seqs = [others[0][0], n, *(s for s, _ in others[1:])]
    lens = [others[0][1], n - 120, *(m for _, m in others[1:])]
    order = [1, 0, 2, 3]  # the prompt is request 1 of the batch: its table row moves too
    mixed = _attend(q_mixed, table[order], seqs, lens, k, v, threads=2)
    assert torch.equal(mixed[90 : 90 + n - 120], whole[120:])
    assert torch.equal(_attend(q, table, [n], [n], k, v, tokens=3, threads=2), whole)


@pytest.mark.parametrize(("dtype", "dim", "tol"),
                         [(torch.float32, 48, (1e-5, 2e-6)), (torch.bfloat16, 96, (1e-4, 2e-5))])
def test_latent_value_is_the_keys_first_dims(dtype: torch.dtype, dim: int, tol: tuple[float, float]) -> None:
    """MLA's form: one KV 'head' (the latent), the value its first `dv` values, a given scale (in
    bf16 with a head dim of 32-dim steps: the pairs path where the CPU has it)."""
    seqs, lens = [40, 33], [40, 1]
    lat = _pool(16 * PS, 1, dim, dtype, 8)
    table = _table(2, 3, 16)
    q = torch.randn(sum(lens), 4, dim, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = _attend(q, table, seqs, lens, lat, lat, tokens=1, dv=32, scale=0.3)
    torch.testing.assert_close(got.double(), _reference(q, table, seqs, lens, lat, lat, 32, 0.3), rtol=tol[0],
                               atol=tol[1])


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a C compiler the library is None (and the torch path attends: fits is False)."""
    cpu_kernels.library.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    try:
        assert cpu_kernels.library() is None
        assert not cpu_attention.fits(torch.float32, 64)
    finally:
        cpu_kernels.library.cache_clear()
        monkeypatch.delenv("CC")
        assert cpu_kernels.library() is not None


def test_unwritable_cache_means_no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """A cache directory that cannot be made (here: a file in its way) is logged, not a crash."""
    from engine.env import Env

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    fake = Env(cache_dir=blocker, log_level="info", log_json=None, digest_every=64, git_commit=None,
               profile_steps=None)
    cpu_kernels.library.cache_clear()
    monkeypatch.setattr(cpu_kernels, "env", lambda: fake)
    try:
        assert cpu_kernels.library() is None
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None


def test_scratch_covers_every_block_of_a_range() -> None:
    """A thread's item range may start and end inside a block's KV heads (plan cuts items by
    work): the scratch is sized for the largest block it touches, the last one included."""
    blocks = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1], [0, 2, 1, 2], [1, 3, 64, 500]], dtype=torch.int32)
    kv_heads, g, dq, dv, chunk = 3, 3, 64, 64, 64
    fixed = dq * chunk + chunk * dv

    def want(*used: int) -> int:
        rows = max(int(blocks[b, 2]) * g for b in used)
        widths = {b: -(-int(blocks[b, 3] + blocks[b, 2]) // chunk) * chunk for b in used}
        fma = fixed + max(int(blocks[b, 2]) * g * widths[b] for b in used) + rows * dv + 2 * rows  # sums, maxima

        def pairs(r: int, w: int) -> int:  # attend_item_pairs: a row tile's scores and outputs, a row, Q, K, V
            return 16 * w + 16 * dv + w + -(-r // 16) * 16 * dq // 2 + w // 16 * (dq // 32) * 256 + w // 2 * dv

        need = max(pairs(int(blocks[b, 2]) * g, widths[b]) for b in used) if cpu_attention.bf16_dot_unit() else 0
        return max(fma, need)

    lib = cpu_attention.library()
    assert lib.strata_scratch(blocks.data_ptr(), 5, 10, kv_heads, g, dq, dv) == want(1, 2, 3)  # items 5..9
    assert lib.strata_scratch(blocks.data_ptr(), 0, 3, kv_heads, g, dq, dv) == want(0)



@pytest.mark.skipif(not cpu_attention.bf16_dot_unit() or not cpu_attention.bf16_dot_applies(64, 64, PS, 1),
                    reason="no AMX-BF16 or AVX512-BF16 here (or Linux does not grant the tile state)")
def test_bf16_queries_take_the_pairs_path_here() -> None:
    """Where the CPU has AMX or AVX512-BF16, bf16 queries over bf16 KV are the pairs path: other last
    bits than the float path's on the same values (the same queries as float32), close to them."""
    seqs, lens = [150, 64], [150, 1]
    k, v = _pool(64 * PS, 3, 64, torch.bfloat16, 1), _pool(64 * PS, 3, 64, torch.bfloat16, 2)
    table = _table(2, 10, 64)
    q = torch.randn(sum(lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tiles, floats = _attend(q, table, seqs, lens, k, v), _attend(q.float(), table, seqs, lens, k, v)
    assert not torch.equal(tiles, floats)
    torch.testing.assert_close(tiles, floats, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_pages_of_64_tokens(q_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """--page-size 64 (the pairs path loads each page's keys 16 rows at a time): close to float64, and
    a prompt's rows whole equal its rows in chunks of 37."""
    monkeypatch.setattr(sys.modules[__name__], "PS", 64)  # the helpers' page size
    pages = 4  # per request: 256 tokens
    k, v = _pool(3 * pages * 64 + 64, 3, 64, torch.bfloat16, 1), _pool(3 * pages * 64 + 64, 3, 64, torch.bfloat16, 2)
    table = _table(3, pages, 3 * pages + 1)
    seqs, lens = [200, 130, 64], [200, 17, 1]
    q = torch.randn(sum(lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    got = _attend(q, table, seqs, lens, k, v)
    torch.testing.assert_close(got.double(), _reference(q, table, seqs, lens, k, v, 64, 64**-0.5), rtol=1e-4,
                               atol=2e-5)
    whole = got[:200]
    chunks = [_attend(q[s : min(200, s + 37)], table[:1], [min(200, s + 37)], [min(37, 200 - s)], k, v)
              for s in range(0, 200, 37)]
    assert torch.equal(torch.cat(chunks), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_read_in_place_and_bf16_out_are_the_same_values(dtype: torch.dtype) -> None:
    """q as a view of a wider projection output (tokens a row stride apart, as the fused QKV gives it)
    and the output written as bf16 by the kernel: bit for bit the contiguous q's float32 output rounded."""
    seqs, lens = [40, 23], [40, 7]
    k, v = _pool(16 * PS, 2, 32, dtype, 1), _pool(16 * PS, 2, 32, dtype, 2)
    table = _table(2, 3, 16)
    wide = torch.randn(sum(lens), 10 * 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = wide[:, 32 : 32 + 4 * 32].view(sum(lens), 4, 32)  # heads adjacent, rows 320 apart
    assert not q.is_contiguous()
    p = cpu_attention.plan(table, seqs, lens, 2, 2)
    want = cpu_attention.attend(q.contiguous(), p, k, v, PS, 0.2)
    assert torch.equal(cpu_attention.attend(q, p, k, v, PS, 0.2), want)
    assert torch.equal(cpu_attention.attend(q, p, k, v, PS, 0.2, out_dtype=torch.bfloat16), want.to(torch.bfloat16))
