//! The forward on Hopper's warpgroup products (SM90a): FlashAttention's loop with both products
//! issued by a warpgroup of 128 units as `wgmma` ([`wgmma`](crate::kernel::tile::wgmma)), the
//! scores read from shared memory tiles the copy engine fills (tensor maps, 128-byte swizzle),
//! the probabilities fed to the second product from the registers the first left them in.
//!
//! A cube owns 64 query rows per warpgroup (three at head dim 64, two at 128) and walks blocks
//! of 128 keys double-buffered. A producer unit in a warp of its own issues the copies: a
//! stage is refilled as soon as every warpgroup has released it, each stage's full and empty
//! barriers saying when. Each warpgroup runs `S = Q·Kᵀ`, the online softmax on the
//! accumulators (a row's four lanes combined by shuffles), then `O += P·V`, waiting on nothing
//! of the others: they fall out of step, and one's softmax runs while another's products hold
//! the tensor cores. Persistent (`cfg.persistent`), a cube per SM walks query blocks in a
//! loop, two query slots deep, so that the next block's queries and first keys are in flight
//! while the current block's last products run and its rows are written: an SM holds one cube,
//! whose start and end would otherwise idle it. Plain and causal attention (any diagonal
//! offset), head dims 64 and 128, 16-bit inputs, with a boolean mask packed into bits
//! (`cfg.mask`, a row per query or, `cfg.key_mask`, one for every query: each query block
//! walks only the key blocks its mask lets it see, and a warp whose rows a block hides nothing
//! from skips the test), an additive bias (`cfg.bias`: the producer copies each key block's
//! bias beside its keys and values) and dropout (`cfg.dropout`: the tile's generator, one hash
//! per four probabilities of a row); every other feature takes the tensor-core tile.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use cubecl::zspace::Shape;

use crate::kernel::config::{ScoreParams, TilePath, WarpgroupConfig};
use crate::kernel::dropout::{Dropout, keep_probabilities};
use crate::kernel::inputs::{broadcast, hidden_row, visible_range};
use crate::kernel::pack::PackedMask;
use crate::kernel::softmax::{exp2, reciprocal};
use crate::kernel::tensors::KernelTensor;
use crate::kernel::tile::wgmma::{
    descriptor, descriptor_across_rows, position, product, product_pv, swizzled, wait_products,
};

/// The units of a cube: the computing warpgroups', then the producer's warp.
pub(crate) fn cube_dim(cfg: &WarpgroupConfig) -> CubeDim {
    CubeDim::new_1d(consumers(cfg) as u32 + 32)
}

/// The units that compute: the warpgroups'.
fn consumers(cfg: &WarpgroupConfig) -> usize {
    128 * cfg.warpgroups
}

/// Score accumulators a unit holds: 64 rows × [`WarpgroupConfig::BLOCK_KV`] keys.
type Scores = Vector<f32, Const<64>>;
/// The probabilities' registers of a unit for one block of 128 keys (8 k-steps of 4).
type Probabilities = Vector<u32, Const<32>>;
/// One barrier per stage of the key/value ring (two stages).
type Ring = (Shared<Barrier>, Shared<Barrier>);

/// Enqueue the forward of contiguous `q: [b, h, sq, d]` and `k`, `v: [b, hkv, sk, d]` (rows
/// readable by tensor maps), hiding what `mask` hides and adding `bias`, into
/// `out: [b, h, sq, d]` and `lse: [b, h, sq]`, as `cfg` plans it
/// ([`ForwardPlan::warpgroup`](super::plan::ForwardPlan::warpgroup)): persistent cubes one an
/// SM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    q: &KernelTensor,
    k: &KernelTensor,
    v: &KernelTensor,
    out: &KernelTensor,
    lse: &KernelTensor,
    mask: Option<&PackedMask>,
    bias: Option<&KernelTensor>,
    params: &ScoreParams,
    cfg: WarpgroupConfig,
) {
    let sms = q.client.properties().hardware.num_streaming_multiprocessors;
    launch_cubes(
        q,
        k,
        v,
        out,
        lse,
        mask,
        bias,
        params,
        cfg,
        sms.map(|n| n as usize),
    );
}

/// [`launch`] with `resident` persistent cubes (all the query blocks' where `None`); a
/// one-block-a-cube `cfg` ignores it. With `cfg.mask`, `mask` is the boolean mask packed for
/// the blocks of `cfg` (`pack_mask(mask, cfg.mask_rows(), BLOCK_KV)`); with `cfg.bias`, `bias`
/// (`[b|1, h|1, sq, sk]`, contiguous, `sk` a multiple of 8) is added to the scores.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_cubes(
    q: &KernelTensor,
    k: &KernelTensor,
    v: &KernelTensor,
    out: &KernelTensor,
    lse: &KernelTensor,
    mask: Option<&PackedMask>,
    bias: Option<&KernelTensor>,
    params: &ScoreParams,
    cfg: WarpgroupConfig,
    resident: Option<usize>,
) {
    let dims = q.meta.shape();
    let (batch, heads, seq_q) = (dims[0], dims[1], dims[2]);
    let (kv_heads, seq_k) = (k.meta.shape()[1], k.meta.shape()[2]);
    let map =
        |t: &KernelTensor, rows: usize| tensor_map(t.clone().into_tensor_arg(), t.dtype, rows);
    let cube_count = cube_count(&cfg, batch, heads, seq_q, resident);
    let cube_dim = cube_dim(&cfg);
    assert!(
        matches!(cfg.head_dim, 64 | 128),
        "the plan takes the warpgroup forward at head dims 64 and 128, not {}",
        cfg.head_dim
    );
    assert_eq!(
        cfg.mask.0,
        mask.is_some(),
        "a packed mask exactly where planned"
    );
    assert_eq!(cfg.bias.0, bias.is_some(), "a bias exactly where planned");
    assert_eq!(
        cfg.dropout.0,
        params.dropout.is_some(),
        "dropout exactly where planned"
    );
    let (seed_lo, seed_hi, threshold) = params.dropout_args();
    if let Some(bias) = bias {
        let dims = bias.meta.shape();
        assert!(
            dims[2] == seq_q && dims[3] == seq_k && (seq_k * 2).is_multiple_of(16),
            "a bias read by a tensor map: a row per query, rows of whole 16 bytes"
        );
        assert_eq!(
            cfg.bias_steps,
            (dims[0] != 1, dims[1] != 1),
            "the bias's batches and heads as planned"
        );
    }
    // SAFETY: the tensor maps bound every read (rows past a sequence arrive as zeros); the
    // kernel writes only rows below `seq_q` of `out` and `lse`, whose shapes the caller
    // allocated from `q`'s, and the caller checked their indices fit 32 bits.
    unsafe {
        warpgroup_forward::launch_unchecked(
            &q.client,
            cube_count,
            cube_dim,
            // The value accumulators a unit holds: half the head dim.
            cfg.head_dim / 2,
            map(q, cfg.block_q()),
            map(k, WarpgroupConfig::BLOCK_KV),
            map(v, WarpgroupConfig::BLOCK_KV),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            mask.map(|m| m.words.clone().into_tensor_arg()).into(),
            mask.map(|m| m.hidden_blocks.clone().into_tensor_arg())
                .into(),
            bias.map(|b| map(b, cfg.block_q())).into(),
            seq_k as u32,
            (heads / kv_heads) as u32,
            params.scale * core::f32::consts::LOG2_E,
            diagonal_bound(params, seq_q, seq_k),
            f32::NEG_INFINITY,
            seed_lo,
            seed_hi,
            threshold,
            cfg,
            q.dtype,
        )
    }
}

/// The last key query 0 sees under a right bound (causal): query `i` sees keys up to
/// `i + bound`, its diagonal bottom-right unless the options align it top-left.
pub(crate) fn diagonal_bound(params: &ScoreParams, seq_q: usize, seq_k: usize) -> i32 {
    let shift = if params.mask.top_left.0 {
        0
    } else {
        seq_k as i64 - seq_q as i64
    };
    i32::try_from(shift + i64::from(params.right)).expect("sequences under 2^31")
}

/// The tensor map the kernel reads a `[b, h, seq, d]` operand of `dtype` by: boxes of `rows`
/// rows × 64 columns (a panel), 128-byte swizzle.
pub(crate) fn tensor_map(tensor: TensorArg, dtype: ElemType, rows: usize) -> TensorMapArg<Tiled> {
    let boxed = Shape::new([1, 1, rows, 64]);
    TensorMapArg::new(TiledArgs::new(boxed), tensor, dtype).with_swizzle(TensorMapSwizzle::B128)
}

/// The grid: one cube per (query block, head, batch); persistent, one dimension of `resident`
/// cubes at most (one an SM), each walking every `resident`-th query block.
pub(crate) fn cube_count(
    cfg: &WarpgroupConfig,
    batch: usize,
    heads: usize,
    seq_q: usize,
    resident: Option<usize>,
) -> CubeCount {
    let q_blocks = seq_q.div_ceil(cfg.block_q());
    if cfg.persistent {
        let blocks = q_blocks * heads * batch;
        let cubes = resident.map_or(blocks, |r| r.clamp(1, blocks.max(1)));
        CubeCount::Static(u32::try_from(cubes).expect("query blocks under 2^32"), 1, 1)
    } else if cfg.batch_inner {
        CubeCount::Static(q_blocks as u32, batch as u32, heads as u32)
    } else {
        CubeCount::Static(q_blocks as u32, heads as u32, batch as u32)
    }
}

/// The forward of 128-row query blocks of `[b, h, sq, d]` queries: one a cube (the grid's
/// x, y, z being the block, head and batch; with `cfg.batch_inner` the block, batch and head),
/// or, with `cfg.persistent`, every `CUBE_COUNT_X`-th block from `CUBE_POS_X` (query block
/// fastest, then head, then batch; [`tile_rows`]).
/// `q_map`, `k_map`, `v_map` are tensor maps of the queries and of `[b, hkv, sk, d]` keys and
/// values (boxes of 64 columns, 128-byte swizzle); `out` is `[b, h, sq, d]`, `lse` `[b, h, sq]`
/// (natural log, `-inf` where a row sees no key). Key `j` is visible to query `i` where
/// `j < seq_k`, with `cfg.causal` `j <= i + bound`, and with `cfg.mask` where the packed mask
/// (`mask_words` and `hidden_blocks`, [`pack`](crate::kernel::pack), for this config's blocks)
/// does not hide it; with `cfg.bias`, `bias` over the softmax scale is added to each raw score
/// (`scale` is the softmax scale times log2 e). `O` is the value accumulators' vector
/// (`d / 2`).
// The cube's built-ins are placeholder constants on the host side, where rustc would evaluate
// the grid's reversal; in the kernel `CUBE_POS_X < CUBE_COUNT_X`.
#[allow(arithmetic_overflow)]
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn warpgroup_forward<E: Float, O: Size>(
    q_map: &TensorMap<E, Tiled>,
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    mask_words: ComptimeOption<&Tensor<u32>>,
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    bias: ComptimeOption<&TensorMap<E, Tiled>>,
    seq_k: u32,
    group: u32,
    scale: f32,
    bound: i32,
    neg_inf: f32,
    dropout_seed_lo: u32,
    dropout_seed_hi: u32,
    dropout_threshold: u32,
    #[comptime] cfg: WarpgroupConfig,
    #[define(E)] _dtype: ElemType,
) {
    let block_q = comptime!(cfg.block_q());
    let computing = comptime!(consumers(&cfg) as u32);
    let block_kv = comptime!(WarpgroupConfig::BLOCK_KV);
    let d = comptime!(cfg.head_dim);
    let q_len = comptime!(block_q * d);
    let seq_q = out.shape(2);
    let seq_k = seq_k as usize;
    let dropout = Dropout::with_scale(
        dropout_seed_lo,
        dropout_seed_hi,
        dropout_threshold,
        256.0 * reciprocal(f32::cast_from(dropout_threshold)),
        out.shape(1),
        seq_k,
    );

    let mut queries =
        Shared::<[E]>::new_aligned_slice(comptime!(cfg.query_slots() * q_len), 1024usize);
    let mut keys = Shared::<[E]>::new_aligned_slice(comptime!(2 * block_kv * d), 1024usize);
    let mut values = Shared::<[E]>::new_aligned_slice(comptime!(2 * block_kv * d), 1024usize);
    let mut biases = bias_stages::<E>(cfg);
    // A stage or query slot is full when the copy engine has written it (the producer's one
    // arrival, with the bytes it expects), empty when every consumer unit is done with it.
    let queries_full = Barrier::shared(1, UNIT_POS == 0);
    let full = (
        Barrier::shared(1, UNIT_POS == 0),
        Barrier::shared(1, UNIT_POS == 0),
    );
    let empty = (
        Barrier::shared(computing, UNIT_POS == 0),
        Barrier::shared(computing, UNIT_POS == 0),
    );
    if comptime!(cfg.persistent) {
        // The second query slot, and both slots' release.
        let second_queries_full = Barrier::shared(1, UNIT_POS == 0);
        let queries_empty = Barrier::shared(computing, UNIT_POS == 0);
        let second_queries_empty = Barrier::shared(computing, UNIT_POS == 0);
        // The copy engine completes on the barriers: their initialisation must be visible to it.
        sync_async_proxy_shared();
        sync_cube();
        let heads = out.shape(1);
        let q_blocks = seq_q.div_ceil(block_q);
        let tiles = out.shape(0) * heads * q_blocks;
        // `ring` counts the key blocks of the query blocks walked before, `walked` those.
        let mut ring = 0usize;
        let mut walked = 0usize;
        let mut tile = CUBE_POS_X as usize;
        while tile < tiles {
            let (batch, head, q_start) = tile_rows(tile, out.shape(0), heads, q_blocks, tiles, cfg);
            let end = key_blocks_end(q_start, seq_k, bound, cfg);
            let (first, end) = visible_blocks(hidden_blocks, batch, head, q_start, end, cfg);
            let slot = walked % 2;
            if UNIT_POS == computing {
                // Use `n` of a slot waits for its release `n - 1`.
                let release = (walked / 2 + 1) as u32 % 2;
                if slot == 0 {
                    if walked >= 2 {
                        queries_empty.wait_parity(release);
                    }
                    load_queries::<E>(
                        &queries_full,
                        q_map,
                        &mut queries,
                        0,
                        batch,
                        head,
                        q_start,
                        cfg,
                    );
                } else {
                    if walked >= 2 {
                        second_queries_empty.wait_parity(release);
                    }
                    load_queries::<E>(
                        &second_queries_full,
                        q_map,
                        &mut queries,
                        q_len,
                        batch,
                        head,
                        q_start,
                        cfg,
                    );
                }
                produce_blocks::<E>(
                    ring,
                    first,
                    end,
                    &full,
                    &empty,
                    k_map,
                    v_map,
                    bias,
                    &mut keys,
                    &mut values,
                    &mut biases,
                    batch,
                    head,
                    head / group as usize,
                    q_start,
                    cfg,
                );
            } else if UNIT_POS < computing {
                let filled = (walked / 2) as u32 % 2;
                if slot == 0 {
                    queries_full.wait_parity(filled);
                } else {
                    second_queries_full.wait_parity(filled);
                }
                attend_rows::<E, O>(
                    ring,
                    first,
                    end,
                    comptime!((q_len * 2 / 16) as u64) * slot as u64,
                    &queries,
                    &keys,
                    &values,
                    &full,
                    &empty,
                    out,
                    lse,
                    mask_words,
                    &biases,
                    &dropout,
                    batch,
                    head,
                    q_start,
                    seq_q,
                    seq_k,
                    scale,
                    bound,
                    neg_inf,
                    cfg,
                );
                // The slot's queries are read by the scores' products alone, all waited for.
                if slot == 0 {
                    queries_empty.arrive();
                } else {
                    second_queries_empty.arrive();
                }
            }
            ring += end - first;
            walked += 1;
            if comptime!(cfg.causal) {
                tile = walked_tile(walked);
            } else {
                tile += CUBE_COUNT_X as usize;
            }
        }
    } else {
        sync_async_proxy_shared();
        sync_cube();
        // Causal: the grid runs backwards, so the longest row blocks start first.
        let x = if comptime!(cfg.causal) {
            CUBE_COUNT_X - 1 - CUBE_POS_X
        } else {
            CUBE_POS_X
        };
        let (batch, head) = if comptime!(cfg.batch_inner) {
            (CUBE_POS_Y as usize, CUBE_POS_Z as usize)
        } else {
            (CUBE_POS_Z as usize, CUBE_POS_Y as usize)
        };
        let q_start = x as usize * block_q;
        let end = key_blocks_end(q_start, seq_k, bound, cfg);
        let (first, end) = visible_blocks(hidden_blocks, batch, head, q_start, end, cfg);
        if UNIT_POS == computing {
            load_queries::<E>(
                &queries_full,
                q_map,
                &mut queries,
                0,
                batch,
                head,
                q_start,
                cfg,
            );
            produce_blocks::<E>(
                0usize,
                first,
                end,
                &full,
                &empty,
                k_map,
                v_map,
                bias,
                &mut keys,
                &mut values,
                &mut biases,
                batch,
                head,
                head / group as usize,
                q_start,
                cfg,
            );
        } else if UNIT_POS < computing {
            queries_full.wait_parity(0);
            attend_rows::<E, O>(
                0usize, first, end, 0u64, &queries, &keys, &values, &full, &empty, out, lse,
                mask_words, &biases, &dropout, batch, head, q_start, seq_q, seq_k, scale, bound,
                neg_inf, cfg,
            );
        }
    }
}

/// Batch, head and first row of a persistent cube's query block `tile` (of `tiles`, `q_blocks`
/// a head of `batches` × `heads`). Query block fastest, then head, then batch (with
/// `cfg.batch_inner` batch, then head: the cubes of a pass read one head's bias); under a
/// causal mask, where a head's blocks differ in length, each head's last-first, or, where the
/// grid has two cubes or more a (batch, head) pair, every pair's longest block before any
/// pair's next: a pass over the grid then holds blocks of about one length, and in both orders
/// the cubes of a pass share the keys of a few heads in L2 (with fewer than two cubes a pair,
/// a pass of the second order would read a head's keys once per cube).
#[cube]
fn tile_rows(
    tile: usize,
    batches: usize,
    heads: usize,
    q_blocks: usize,
    tiles: usize,
    #[comptime] cfg: WarpgroupConfig,
) -> (usize, usize, usize) {
    let mut pair = tile / q_blocks;
    let mut x = tile % q_blocks;
    if comptime!(cfg.causal) {
        let pairs = tiles / q_blocks;
        if 2 * pairs <= CUBE_COUNT_X as usize {
            pair = tile % pairs;
            x = tile / pairs;
        }
        x = q_blocks - 1 - x;
    }
    if comptime!(cfg.batch_inner) {
        (pair % batches, pair / batches, x * cfg.block_q())
    } else {
        (pair / heads, pair % heads, x * cfg.block_q())
    }
}

/// The query block a persistent cube walks `n`-th under a causal mask: pass `n` over the grid
/// hands cube `c` block `n·C + c` (`C` cubes) on even passes, `n·C + C − 1 − c` on odd ones
/// (without a mask, a plain stride: every block is as long). Blocks differ in length, and with
/// a plain stride the lengths a cube meets repeat with `C`
/// modulo the blocks a head (cube `c` of 132 over 16 blocks a head walks blocks `c, c + 4,
/// c + 8, c + 12`, up to 43 % more work than another); backwards every other pass each walks
/// `c, 7 − c, 8 + c, 15 − c`, the same sum for all. With [`tile_rows`]' orders, the heaviest
/// cube's work is within 3 % of the mean on the FlashAttention-2 benchmark shapes (a stride
/// alone: up to 1.97×).
// The cube's built-ins are placeholder constants on the host side, where rustc would evaluate
// the reversal; in the kernel `CUBE_POS_X < CUBE_COUNT_X`.
#[allow(arithmetic_overflow)]
#[cube]
fn walked_tile(n: usize) -> usize {
    let (cube, cubes) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let mut at = cube;
    if n % 2 == 1 {
        at = cubes - 1 - cube;
    }
    n * cubes + at
}

/// The producer's copy of a query block's rows `[q_start, q_start + block_q)` of (batch, head)
/// into the query slot at `slot`, completing on `full` (its arrival with the bytes expected
/// first, so that the phase cannot complete without them).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_queries<E: Float>(
    full: &Barrier,
    q_map: &TensorMap<E, Tiled>,
    queries: &mut Shared<[E]>,
    slot: usize,
    batch: usize,
    head: usize,
    q_start: usize,
    #[comptime] cfg: WarpgroupConfig,
) {
    let block_q = comptime!(cfg.block_q());
    full.arrive_and_expect_tx(1, comptime!((block_q * cfg.head_dim * 2) as u32));
    load_panels::<E>(
        full,
        q_map,
        queries,
        slot,
        batch,
        head,
        q_start,
        block_q,
        cfg.head_dim,
    );
}

/// The producer's copies of the key blocks `[first, end)` of (batch, kv_head) into the
/// ring's two stages, with the bias block of the query block from `q_start` where `cfg.bias`,
/// each as soon as its stage is empty: the `n`-th block's `ring + n`-th use of the ring waits
/// for its stage's release by the use two before.
#[cube]
#[allow(clippy::too_many_arguments)]
fn produce_blocks<E: Float>(
    ring: usize,
    first: usize,
    end: usize,
    full: &Ring,
    empty: &Ring,
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    bias: ComptimeOption<&TensorMap<E, Tiled>>,
    keys: &mut Shared<[E]>,
    values: &mut Shared<[E]>,
    biases: &mut ComptimeOption<Shared<[E]>>,
    batch: usize,
    head: usize,
    kv_head: usize,
    q_start: usize,
    #[comptime] cfg: WarpgroupConfig,
) {
    for block in first..end {
        let issued = ring + block - first;
        let stage = issued % 2;
        let release = (issued / 2 + 1) as u32 % 2;
        if stage == 0 {
            if issued >= 2 {
                empty.0.wait_parity(release);
            }
            fetch_block::<E>(
                &full.0, k_map, v_map, bias, keys, values, biases, 0, batch, head, kv_head,
                q_start, block, cfg,
            );
        } else {
            if issued >= 2 {
                empty.1.wait_parity(release);
            }
            fetch_block::<E>(
                &full.1, k_map, v_map, bias, keys, values, biases, 1, batch, head, kv_head,
                q_start, block, cfg,
            );
        }
    }
}

/// A computing unit's part of a query block (its queries in `queries` from 16-byte unit
/// `slot_units`, already full): the online softmax over its key blocks `[first, end)`, the
/// `n`-th the `ring + n`-th use of the ring (waited for full, released once its values product
/// is done), the keys its packed mask hides (`mask_words`) at `-inf`, then its rows of `out`
/// and `lse` written.
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_rows<E: Float, O: Size>(
    ring: usize,
    first: usize,
    end: usize,
    slot_units: u64,
    queries: &Shared<[E]>,
    keys: &Shared<[E]>,
    values: &Shared<[E]>,
    full: &Ring,
    empty: &Ring,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    mask_words: ComptimeOption<&Tensor<u32>>,
    biases: &ComptimeOption<Shared<[E]>>,
    dropout: &Dropout,
    batch: usize,
    head: usize,
    q_start: usize,
    seq_q: usize,
    seq_k: usize,
    scale: f32,
    bound: i32,
    neg_inf: f32,
    #[comptime] cfg: WarpgroupConfig,
) {
    let block_q = comptime!(cfg.block_q());
    let block_kv = comptime!(WarpgroupConfig::BLOCK_KV);
    let d = comptime!(cfg.head_dim);
    let unit = UNIT_POS as usize % 128;
    let warpgroup = UNIT_POS as usize / 128;
    // This unit's two rows of the warpgroup's 64: `16 w + lane / 4` and 8 below.
    let row = q_start + warpgroup * 64 + position(unit, 0usize).0;
    let rows_start = q_start + warpgroup * 64;
    // Descriptors in 16-byte units: the warpgroup's 64 rows of the query block's panels,
    // and each stage's first key row.
    let query_desc = descriptor::<E>(queries)
        + slot_units
        + comptime!((64 * 64 * 2 / 16) as u64) * warpgroup as u64;
    let keys_desc = descriptor::<E>(keys);
    let values_desc = descriptor_across_rows::<E>(values, comptime!((block_kv * 128) as u64));
    let stage_units = comptime!((block_kv * d * 2 / 16) as u64);
    let head_key = dropout.head_key(batch, head);

    let mut o = Vector::<f32, O>::new(0.0);
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        row_max[h] = neg_inf;
        row_sum[h] = 0.0;
    }

    for block in first..end {
        let issued = ring + block - first;
        let stage = issued % 2;
        let filled = (issued / 2) as u32 % 2;
        if stage == 0 {
            full.0.wait_parity(filled);
        } else {
            full.1.wait_parity(filled);
        }
        let stage_offset = stage_units * stage as u64;
        let s = product::<Const<64>>(
            query_desc,
            keys_desc + stage_offset,
            block_q,
            block_kv,
            d,
            cfg.bf16,
        );
        let key_start = block * block_kv;
        // The block's mask words are read while its product runs: read after it, their
        // latency would stall every block.
        let mut words = (
            Vector::<u32, Const<4>>::empty(),
            Vector::<u32, Const<4>>::empty(),
        );
        #[comptime]
        if let ComptimeOption::Some(mask_words) = mask_words {
            words = mask_rows(mask_words, batch, head, block, row, cfg.key_mask);
        }
        wait_products();
        // Only the blocks that cross the sequence's end or a diagonal of the warpgroup's
        // rows test each score.
        let crosses_end = key_start + block_kv > seq_k;
        let crosses_diagonal =
            comptime!(cfg.causal) && (key_start + block_kv - 1) as i32 > rows_start as i32 + bound;
        let mut s = if crosses_end || crosses_diagonal {
            masked_scores(s, key_start, row, seq_k, bound, neg_inf, cfg)
        } else {
            s
        };
        if comptime!(cfg.mask.0) {
            s = hide_masked(s, words, neg_inf);
        }
        #[comptime]
        if let ComptimeOption::Some(stages) = biases {
            s = add_bias::<E>(s, stages, stage, scale, cfg);
        }
        let mut p = online_softmax::<E, O>(&s, scale, &mut o, &mut row_max, &mut row_sum, neg_inf);
        if comptime!(cfg.dropout.0) {
            p = keep_probabilities(p, dropout, head_key, row, unit, key_start);
        }
        o = product_pv::<O, Const<32>>(o, p, values_desc + stage_offset, block_kv, d, cfg.bf16);
        wait_products();
        if stage == 0 {
            empty.0.arrive();
        } else {
            empty.1.arrive();
        }
    }

    // Kept probabilities are scaled up once, with the rows' normaliser.
    let out_scale = select(comptime!(cfg.dropout.0), dropout.scale, 1.0f32);
    write_rows::<E, O>(
        &o, &row_max, &row_sum, out, lse, batch, head, row, seq_q, scale, out_scale, neg_inf,
    );
}

/// The key blocks the query block `[q_start, q_start + cfg.block_q())` sees: up to the sequence's end
/// and, causal, to its last row's diagonal (none where that lies before the first key).
#[cube]
fn key_blocks_end(
    q_start: usize,
    seq_k: usize,
    bound: i32,
    #[comptime] cfg: WarpgroupConfig,
) -> usize {
    let block_kv = comptime!(WarpgroupConfig::BLOCK_KV);
    let all = seq_k.div_ceil(block_kv);
    if comptime!(cfg.causal) {
        let last_key = (q_start + cfg.block_q() - 1) as i32 + bound;
        if last_key < 0 {
            0usize
        } else {
            min(all, last_key as usize / block_kv + 1)
        }
    } else {
        all
    }
}

/// Copy `rows` rows of (batch, head) from `row` of `map`, `d` columns as panels of 64 (one box
/// each, `rows` × 128 bytes), into `stages` from `start`, completing on `barrier`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_panels<E: Float>(
    barrier: &Barrier,
    map: &TensorMap<E, Tiled>,
    stages: &mut Shared<[E]>,
    start: usize,
    batch: usize,
    head: usize,
    row: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let panel = comptime!(rows * 64);
    #[unroll]
    for p in 0..comptime!(d / 64) {
        let at = start + comptime!(p * panel);
        barrier.tma_load_4d(
            map,
            stages.slice_mut(at, at + panel),
            batch as i32,
            head as i32,
            row as i32,
            comptime!(p * 64) as i32,
        );
    }
}

/// Issue key block `block`'s keys and values of (batch, kv_head) into stage `stage`, and
/// where `cfg.bias` the bias of (batch, head)'s query block from `q_start` over those keys,
/// completing on `barrier`: the producer's arrival with the bytes it expects, before the
/// copies, so that the phase cannot complete without them. Rows and keys past the sequences
/// arrive as zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_block<E: Float>(
    barrier: &Barrier,
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    bias: ComptimeOption<&TensorMap<E, Tiled>>,
    keys: &mut Shared<[E]>,
    values: &mut Shared<[E]>,
    biases: &mut ComptimeOption<Shared<[E]>>,
    stage: usize,
    batch: usize,
    head: usize,
    kv_head: usize,
    q_start: usize,
    block: usize,
    #[comptime] cfg: WarpgroupConfig,
) {
    let block_kv = comptime!(WarpgroupConfig::BLOCK_KV);
    let stage_len = comptime!(block_kv * cfg.head_dim);
    let bias_len = comptime!(cfg.bias_stage_len());
    barrier.arrive_and_expect_tx(1, comptime!(((2 * stage_len + bias_len) * 2) as u32));
    let (start, row) = (stage * stage_len, block * block_kv);
    load_panels::<E>(
        barrier,
        k_map,
        keys,
        start,
        batch,
        kv_head,
        row,
        block_kv,
        cfg.head_dim,
    );
    load_panels::<E>(
        barrier,
        v_map,
        values,
        start,
        batch,
        kv_head,
        row,
        block_kv,
        cfg.head_dim,
    );
    #[comptime]
    if let ComptimeOption::Some(stages) = biases {
        #[comptime]
        if let ComptimeOption::Some(map) = bias {
            // A bias of one batch or head is read for every batch or head.
            let bias_batch = select(comptime!(cfg.bias_steps.0), batch, 0usize);
            let bias_head = select(comptime!(cfg.bias_steps.1), head, 0usize);
            let panel = comptime!(cfg.block_q() * 64);
            #[unroll]
            for p in 0..comptime!(block_kv / 64) {
                let at = stage * bias_len + comptime!(p * panel);
                barrier.tma_load_4d(
                    map,
                    stages.slice_mut(at, at + panel),
                    bias_batch as i32,
                    bias_head as i32,
                    q_start as i32,
                    (row + comptime!(p * 64)) as i32,
                );
            }
        }
    }
}

/// The raw scores with the keys past `seq_k` and, causal, right of each row's diagonal at
/// `-inf`: key `key_start + col` of row `row` (+ 8 for the accumulators of the lower half).
#[cube]
fn masked_scores(
    s: Scores,
    key_start: usize,
    row: usize,
    seq_k: usize,
    bound: i32,
    neg_inf: f32,
    #[comptime] cfg: WarpgroupConfig,
) -> Scores {
    let unit = UNIT_POS as usize % 128;
    let mut t = s;
    #[unroll]
    for nth in 0..64usize {
        let (_, col) = position(unit, nth);
        let key = key_start + col;
        let query = row + comptime!((nth % 4) / 2 * 8);
        let mut visible = key < seq_k;
        if comptime!(cfg.causal) {
            visible = visible && key as i32 <= query as i32 + bound;
        }
        t.insert(nth, select(visible, s.extract(nth), neg_inf));
    }
    t
}

/// The bias stages where `cfg.bias`: two, each the query block's rows over a key block's
/// keys, as panels of 64 keys (the tensor map's boxes, 128-byte swizzle).
#[cube]
fn bias_stages<E: Float>(#[comptime] cfg: WarpgroupConfig) -> ComptimeOption<Shared<[E]>> {
    if comptime!(cfg.bias.0) {
        let len = comptime!(2 * cfg.bias_stage_len());
        ComptimeOption::new_Some(Shared::<[E]>::new_aligned_slice(len, 1024usize))
    } else {
        ComptimeOption::new_None()
    }
}

/// The scores `s` plus the bias over the softmax scale (`scale` is it times log2 e; the scale
/// multiplies the sum, and a launch argument fewer keeps the kernels without a bias as they
/// were), read from stage `stage` of `stages` ([`bias_stages`]): each pair of accumulators
/// (`2f`, `2f + 1`: same row, adjacent keys) one 4-byte read, the eight rows of a warp's read
/// in distinct banks by the swizzle. Rows and keys past the sequences read zeros.
#[cube]
fn add_bias<E: Float>(
    s: Scores,
    stages: &Shared<[E]>,
    stage: usize,
    scale: f32,
    #[comptime] cfg: WarpgroupConfig,
) -> Scores {
    // Not a division: its slow path is a call, which would serialise the kernel's products.
    let inv_scale = comptime!(core::f32::consts::LOG2_E) * reciprocal(scale);
    let unit = UNIT_POS as usize % 128;
    let rows = (UNIT_POS as usize / 128) * 64;
    let panel = comptime!(cfg.block_q() * 64);
    let base = stage * comptime!(cfg.bias_stage_len());
    let mut t = s;
    #[unroll]
    for f in 0..32usize {
        let (row, col) = position(unit, comptime!(2 * f));
        let at = base + comptime!(f / 16 * panel) + swizzled(rows + row, col % 64);
        let pair = stages
            .slice(at, at + 2)
            .as_vectorized()
            .with_vector_size::<Const<2>>()[0];
        #[unroll]
        for half in 0..2usize {
            let nth = comptime!(2 * f + half);
            t.insert(
                nth,
                s.extract(nth) + f32::cast_from(pair.extract(half)) * inv_scale,
            );
        }
    }
    t
}

/// The packed mask `words` of key block `block` for the unit's rows (`row` and 8 below), 4
/// words a row of 128 keys, bit `j % 32` of word `j / 32` for key `j`
/// ([`pack`](crate::kernel::pack): `[b|1, h|1, blocks, rows · 4]`); with `key_mask`, the
/// mask's one row for both.
#[cube]
fn mask_rows(
    words: &Tensor<u32>,
    batch: usize,
    head: usize,
    block: usize,
    row: usize,
    #[comptime] key_mask: bool,
) -> (Vector<u32, Const<4>>, Vector<u32, Const<4>>) {
    let rows = broadcast::<u32>(words, batch, head).base + block * words.stride(2);
    if comptime!(key_mask) {
        let keys = row_words(words, rows);
        (keys, keys)
    } else {
        (
            row_words(words, rows + row * 4),
            row_words(words, rows + row * 4 + 32),
        )
    }
}

/// The 4 words of a packed row from `at`, in one load.
#[cube]
fn row_words(words: &Tensor<u32>, at: usize) -> Vector<u32, Const<4>> {
    words
        .slice(at, at + 4)
        .as_vectorized()
        .with_vector_size::<Const<4>>()[0]
}

/// The scores `s` with the keys the unit's rows' mask words ([`mask_rows`]) hide at `-inf`. A
/// block whose words hide nothing from any row of the warp is left as it is.
#[cube]
fn hide_masked(
    s: Scores,
    words: (Vector<u32, Const<4>>, Vector<u32, Const<4>>),
    neg_inf: f32,
) -> Scores {
    let (upper, lower) = words;
    let mut any = 0u32;
    #[unroll]
    for w in 0..4usize {
        any |= upper.extract(w) | lower.extract(w);
    }
    let mut t = s;
    if plane_any(any != 0) {
        let unit = UNIT_POS as usize % 128;
        #[unroll]
        for nth in 0..64usize {
            let (_, col) = position(unit, nth);
            // Key `col` of the block is bit `col % 32` of word `col / 32 = nth / 16`.
            let bits = if comptime!((nth % 4) / 2 == 0) {
                upper.extract(comptime!(nth / 16))
            } else {
                lower.extract(comptime!(nth / 16))
            };
            let hidden = (bits >> (col % 32) as u32) & 1u32 == 1u32;
            t.insert(nth, select(hidden, neg_inf, s.extract(nth)));
        }
    }
    t
}

/// The key blocks `[first, end)` a query block walks: `[0, end)` narrowed by its packed mask's
/// visible range ([`visible_range`]); `[0, end)` without a mask.
#[cube]
fn visible_blocks(
    hidden_blocks: ComptimeOption<&Tensor<u32>>,
    batch: usize,
    head: usize,
    q_start: usize,
    end: usize,
    #[comptime] cfg: WarpgroupConfig,
) -> (usize, usize) {
    // A key mask is packed as one query block, every query block's.
    let q_block = select(
        comptime!(cfg.key_mask),
        0usize,
        q_start / comptime!(cfg.block_q()),
    );
    let row = hidden_row(hidden_blocks, batch, head, q_block);
    let (first, end) = visible_range(hidden_blocks, row, 0usize, end);
    // A query block that sees no key has an empty range, `first` past `end`.
    (min(first, end), end)
}

/// The online softmax of one block's raw scores `s`, `scale` being the softmax scale times
/// log2 e (each probability one multiply-add and a base-2 exponential): each row's max and sum
/// moved on, `o` rescaled, and the probabilities returned as the registers of `O += P·V`
/// (accumulators `2f` and `2f + 1` are register `f`: same row, adjacent keys). A row that has
/// seen no key yet keeps a max of `-inf` and probabilities of 0.
#[cube]
fn online_softmax<E: Float, O: Size>(
    s: &Scores,
    scale: f32,
    o: &mut Vector<f32, O>,
    row_max: &mut Array<f32>,
    row_sum: &mut Array<f32>,
    neg_inf: f32,
) -> Probabilities {
    let mut shift = Array::<f32>::new(2usize);
    let mut alpha = Array::<f32>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        let mut m = row_max[h];
        #[unroll]
        for nth in 0..64usize {
            if comptime!((nth % 4) / 2 == h) {
                m = max(m, s.extract(nth));
            }
        }
        m = max(m, plane_shuffle_xor(m, 1));
        m = max(m, plane_shuffle_xor(m, 2));
        // Subtracting -inf would give NaN: a row without keys subtracts 0.
        shift[h] = select(m == neg_inf, 0.0f32, m * scale);
        alpha[h] = exp2(row_max[h] * scale - shift[h], TilePath::TensorCore);
        row_max[h] = m;
        row_sum[h] *= alpha[h];
    }
    let mut p = Probabilities::empty();
    #[unroll]
    for f in 0..32usize {
        let h = comptime!(f % 2);
        let p0 = exp2(
            s.extract(comptime!(2 * f)) * scale - shift[h],
            TilePath::TensorCore,
        );
        let p1 = exp2(
            s.extract(comptime!(2 * f + 1)) * scale - shift[h],
            TilePath::TensorCore,
        );
        row_sum[h] += p0 + p1;
        let mut pair = Vector::<E, Const<2>>::empty();
        pair.insert(0usize, E::cast_from(p0));
        pair.insert(1usize, E::cast_from(p1));
        p.insert(f, u32::reinterpret(pair));
    }
    #[unroll]
    for nth in 0..O::value() {
        let h = comptime!((nth % 4) / 2);
        o.insert(nth, o.extract(nth) * alpha[h]);
    }
    p
}

/// The unit's output values (`o` over each row's sum, times `out_scale`; 0 where the row saw
/// no key) and, from one lane of each row's four, its log-sum-exp (natural log), rows past
/// `seq_q` left.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_rows<E: Float, O: Size>(
    o: &Vector<f32, O>,
    row_max: &Array<f32>,
    row_sum: &Array<f32>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    batch: usize,
    head: usize,
    row: usize,
    seq_q: usize,
    scale: f32,
    out_scale: f32,
    neg_inf: f32,
) {
    let unit = UNIT_POS as usize % 128;
    let mut inverse = Array::<f32>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    #[unroll]
    for h in 0..2usize {
        let part = row_sum[h];
        let pair = part + plane_shuffle_xor(part, 1);
        let sum = pair + plane_shuffle_xor(pair, 2);
        let seen = sum > 0.0;
        inverse[h] = select(seen, reciprocal(sum) * out_scale, 0.0f32);
        row_lse[h] = select(
            seen,
            row_max[h] * scale * core::f32::consts::LN_2 + sum.ln(),
            neg_inf,
        );
    }
    let out_base = batch * out.stride(0) + head * out.stride(1);
    let out_row = out.stride(2);
    #[unroll]
    for nth in 0..O::value() {
        let h = comptime!((nth % 4) / 2);
        let (_, col) = position(unit, nth);
        let query = row + comptime!(h * 8);
        if query < seq_q {
            out[out_base + query * out_row + col] = E::cast_from(o.extract(nth) * inverse[h]);
        }
    }
    // The unit holding the rows' first column.
    if position(unit, 0usize).1 == 0 {
        let lse_base = batch * lse.stride(0) + head * lse.stride(1);
        let lse_row = lse.stride(2);
        #[unroll]
        for h in 0..2usize {
            let query = row + h * 8;
            if query < seq_q {
                lse[lse_base + query * lse_row] = row_lse[h];
            }
        }
    }
}
