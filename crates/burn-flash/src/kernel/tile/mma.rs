//! The tensor-core tile: m16n8k16 `mma.sync` through CubeCL's `MmaDefinition`, operands read
//! from swizzled shared memory with `ldmatrix`. Each plane owns `cfg.plane_rows` query rows (one
//! or two m16 blocks), so every K/V fragment it reads feeds that many MMAs. The query block is
//! staged once in shared memory; its A fragments then either stay in registers for the whole KV
//! loop or, at head dim 128, are re-read per KV block (`cfg.query_in_smem()`). P goes from the S
//! accumulators straight into the A operand of P·V without touching shared memory.

// The cube macro expands `%` itself; `is_multiple_of` has no kernel form.
#![allow(clippy::manual_is_multiple_of)]

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::base::{AttentionTile, zero_scores};
use crate::kernel::config::{CHUNK, MMA_K, MMA_M, MMA_N, Pitch, SMEM_ALIGN, TileConfig};
use crate::kernel::stage::{copy_block_async, stage_offset, swizzled_offset};

/// Two 16-bit values in one 32-bit register, or two f32 accumulators: the MMA register unit.
type Pair<T> = Vector<T, Const<2>>;

/// `mma.sync` tile. Unit (`UNIT_POS_X` = lane, `UNIT_POS_Y` = plane).
pub struct MmaTile;

#[cube]
fn definition<E: Float>() -> MmaDefinition<E, E, f32> {
    MmaDefinition::<E, E, f32>::new(MMA_M, MMA_N, MMA_K)
}

/// The (row, column) of accumulator element `nth` (0..4) of this lane in an m16n8 tile.
#[cube]
fn acc_position<E: Float>(#[comptime] nth: usize) -> (usize, usize) {
    let (row, col) =
        definition::<E>().position_of_nth(UNIT_POS_X, nth as u32, MatrixIdent::Accumulator);
    (row as usize, col as usize)
}

/// What the tensor-core tile multiplies a staged bias block by (`crate::kernel::config::BiasAdd`):
/// the factor itself where it converts per score, and, where the tensor cores add the bias, the
/// B operands that multiply a 16-column A operand by it into the accumulators of one of its two
/// n-tiles: element (k, n) of operand `half` (registers `2 · half`, `2 · half + 1`) is the
/// factor where `k = n + 8 · half`, else 0.
///
/// An operand of `-inf` would meet the zeros (`-inf · 0` is NaN): the MMA reads each bias pair
/// raised to at least `floor`, bf16's lowest finite value, which times a factor above 1.004
/// overflows the f32 product back to `-inf` (the launch takes the MMA only for such factors).
#[derive(CubeType)]
pub struct MmaStagedFactor<E: Float> {
    value: f32,
    diagonals: Array<Pair<E>>,
    floor: Pair<E>,
}

#[cube]
fn pair<T: Float>(first: T, second: T) -> Pair<T> {
    let mut pair = Pair::<T>::empty();
    pair.insert(0usize, first);
    pair.insert(1usize, second);
    pair
}

/// Accumulator registers of n-tile `tile` of `regs`, as the two pairs `mma` consumes.
#[cube]
fn load_acc(regs: &Array<f32>, #[comptime] tile: usize) -> Array<Pair<f32>> {
    let mut acc = Array::<Pair<f32>>::new(2usize);
    acc[0] = pair::<f32>(regs[tile * 4], regs[tile * 4 + 1]);
    acc[1] = pair::<f32>(regs[tile * 4 + 2], regs[tile * 4 + 3]);
    acc
}

#[cube]
fn store_acc(acc: &Array<Pair<f32>>, regs: &mut Array<f32>, #[comptime] tile: usize) {
    regs[tile * 4] = acc[0].extract(0usize);
    regs[tile * 4 + 1] = acc[0].extract(1usize);
    regs[tile * 4 + 2] = acc[1].extract(0usize);
    regs[tile * 4 + 3] = acc[1].extract(1usize);
}

/// Write `factor` times this plane's accumulator-shaped registers `regs` (its `cols` columns per
/// m16 block) to `tile`, a block of rows `width` apart swizzled like the stages, at the positions
/// they stand for, from row `first_row` (a multiple of 8). A lane's pairs of n-tile `n` sit at
/// its accumulator row (+ 8, + 16·m) in chunk `n` of its plane's part: the swizzle key is the
/// lane's, so each n-tile's address is one register and the rows are immediates
/// (`swizzled_offset`).
#[cube]
fn write_tile<E: Float>(
    regs: &Array<f32>,
    factor: f32,
    tile: &mut Shared<[E]>,
    #[comptime] first_row: usize,
    #[comptime] cols: usize,
    #[comptime] width: usize,
    #[comptime] cfg: TileConfig,
) {
    let (lane_row, lane_col) = acc_position::<E>(0usize);
    let part_chunk = plane_part(cfg) * comptime!(cols / CHUNK);
    let n_tiles = comptime!(cols / MMA_N);
    #[unroll]
    for m in 0..cfg.m_tiles() {
        #[unroll]
        for n in 0..n_tiles {
            #[unroll]
            for half in 0..2usize {
                let reg = comptime!((m * n_tiles + n) * 4 + half * 2);
                let at = swizzled_offset(
                    lane_col,
                    group_row(cfg) + lane_row,
                    part_chunk,
                    comptime!(first_row + m * MMA_M + half * 8),
                    n,
                    comptime!(Pitch::rows(width)),
                );
                tile[at] = E::cast_from(regs[reg] * factor);
                tile[at + 1] = E::cast_from(regs[comptime!(reg + 1)] * factor);
            }
        }
    }
}

/// Write this plane's score-shaped registers `regs` to exchange slot `slot` of `tile` as
/// [owned row][staged column] (`cfg.block_kv` wide; slot `s` is rows `s · cfg.block_q` on),
/// where the rows of a group are the A operand of `exchange_product` and, read transposed, of
/// the atomic dQ's.
#[cube]
fn publish<E: Float>(
    regs: &Array<f32>,
    tile: &mut Shared<[E]>,
    #[comptime] slot: usize,
    #[comptime] cfg: TileConfig,
) {
    write_tile::<E>(
        regs,
        1.0,
        tile,
        comptime!(slot * cfg.block_q),
        cfg.score_cols(),
        cfg.block_kv,
        cfg,
    );
}

/// The exchange slot `dS` goes to: the second where there are two, else the first once `P` is
/// done with.
fn grads_slot(cfg: &TileConfig) -> usize {
    cfg.exchange_slots() - 1
}

/// Registers `first..first + count` of `regs` as a new operand array.
#[cube]
fn operand<E: Float>(
    regs: &Array<Pair<E>>,
    #[comptime] first: usize,
    #[comptime] count: usize,
) -> Array<Pair<E>> {
    let mut out = Array::<Pair<E>>::new(count);
    #[unroll]
    for i in 0..count {
        out[i] = regs[first + i];
    }
    out
}

/// First owned row of this plane's rows (planes of a split share theirs; without one the
/// division by 1 folds away).
#[cube]
fn group_row(#[comptime] cfg: TileConfig) -> usize {
    UNIT_POS_Y as usize / cfg.split * cfg.plane_rows
}

/// Which part of its group's staged columns and accumulator columns this plane takes (0 without
/// a split).
#[cube]
fn plane_part(#[comptime] cfg: TileConfig) -> usize {
    UNIT_POS_Y as usize % cfg.split
}

/// Where this plane's part of a split's columns starts in a block laid out by `pitch`, `cols`
/// columns a part: an element offset of whole swizzle groups, added to a base, and a chunk
/// within a group, joined to the lanes' chunks (`with_split` allows parts of 32 columns, half a
/// group, which start at chunk 0 or 4, or whole groups).
#[cube]
fn part_start(
    #[comptime] cols: usize,
    #[comptime] pitch: Pitch,
    #[comptime] cfg: TileConfig,
) -> (usize, usize) {
    let chunk = plane_part(cfg) * comptime!(cols / CHUNK);
    (chunk / 8 * pitch.group, chunk % 8)
}

/// The query block of a cube, staged in shared memory (swizzled like the K/V stages), and the
/// plane's A fragments when they live in registers: 4 registers per (m16 block, 16-deep step),
/// indexed `(m · steps + step) · 4`. With `cfg.query_in_smem()` the register array is a 1-element
/// placeholder.
#[derive(CubeType)]
pub struct MmaQuery<E: Float> {
    stage: Shared<[E]>,
    regs: Array<Pair<E>>,
}

/// `ldmatrix.x4` of the A fragment of m16 block `m`, 16-deep step `step` of this plane's rows
/// of a swizzled tile `width` wide whose rows start at row `first_row` (a multiple of 8): lanes
/// 0–15 address rows 0–15 at the step's first 8 columns, lanes 16–31 the next 8.
#[cube]
fn row_fragment<E: Float>(
    stage: &Shared<[E]>,
    #[comptime] first_row: usize,
    #[comptime] m: usize,
    #[comptime] step: usize,
    #[comptime] width: usize,
    #[comptime] cfg: TileConfig,
) -> Array<Pair<E>> {
    let lane = UNIT_POS_X as usize;
    let lane_row = group_row(cfg) + lane % 16usize;
    let at = swizzled_offset(
        0usize,
        lane_row,
        lane / 16usize,
        comptime!(first_row + m * MMA_M),
        comptime!(step * MMA_K / CHUNK),
        comptime!(Pitch::rows(width)),
    );
    definition::<E>().load_matrix::<E, Const<2>>(
        stage.slice(at, at + CHUNK),
        MatrixIdent::A,
        4usize,
        false,
    )
}

/// The A operand of m16 block `m` at 16-deep step `step`, from registers or shared memory.
#[cube]
fn query_operand<E: Float>(
    query: &MmaQuery<E>,
    #[comptime] m: usize,
    #[comptime] step: usize,
    #[comptime] cfg: TileConfig,
) -> Array<Pair<E>> {
    if comptime!(cfg.query_in_smem()) {
        row_fragment::<E>(
            &query.stage,
            0usize,
            m,
            step,
            comptime!(cfg.head_stride()),
            cfg,
        )
    } else {
        let steps = comptime!(cfg.head_dim / MMA_K);
        operand::<E>(&query.regs, comptime!((m * steps + step) * 4), 4usize)
    }
}

/// (row within the block, column) of register `reg` of an accumulator `cols` wide per plane
/// (the plane's part of the columns under a split): registers are grouped by m16 block, then by
/// n8 tile, 4 per tile.
#[cube]
fn acc_block_position<E: Float>(
    #[comptime] reg: usize,
    #[comptime] cols: usize,
    #[comptime] cfg: TileConfig,
) -> (usize, usize) {
    let per_block = comptime!(cols / MMA_N * 4);
    let m = comptime!(reg / per_block);
    let local = comptime!(reg % per_block);
    let (row, col) = acc_position::<E>(comptime!(local % 4));
    (
        group_row(cfg) + comptime!(m * MMA_M) + row,
        plane_part(cfg) * cols + comptime!(local / 4 * MMA_N) + col,
    )
}

/// One 16-deep step of `acc += A · R`: `a` holds the A operands of `m_tiles` m16 blocks
/// (4 registers each), `R` is rows `row0..row0 + 16` of the swizzled block at `base` in `rows`
/// (laid out by `pitch`), columns `col0..col0 + cols`; `acc` holds `cols / 8` n-tiles per m16
/// block. `ldmatrix.x4.trans` on R: matrices (rows +0, cols +0), (+8, +0), (+0, +8),
/// (+8, +8) are the B operands of two n-tiles. `part_chunk` shifts the columns by that many
/// chunks within a swizzle group (a split plane's part, [`part_start`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn rows_product<E: Float>(
    a: &Array<Pair<E>>,
    rows: &Shared<[E]>,
    base: usize,
    part_chunk: usize,
    acc_regs: &mut Array<f32>,
    #[comptime] row0: usize,
    #[comptime] col0: usize,
    #[comptime] cols: usize,
    #[comptime] pitch: Pitch,
    #[comptime] m_tiles: usize,
) {
    let def = definition::<E>();
    let lane = UNIT_POS_X as usize;
    let lane_row = (lane / 8usize) % 2usize * 8usize + lane % 8usize;
    let lane_chunk = lane / 16usize + part_chunk;
    let out_tiles = comptime!(cols / MMA_N);
    #[unroll]
    for tiles in 0..cols / (2 * MMA_N) {
        let at = swizzled_offset(
            base,
            lane_row,
            lane_chunk,
            row0,
            comptime!((col0 + tiles * 2 * MMA_N) / CHUNK),
            pitch,
        );
        let b = def.load_matrix::<E, Const<2>>(
            rows.slice(at, at + CHUNK),
            MatrixIdent::B,
            4usize,
            true,
        );
        #[unroll]
        for half in 0..2usize {
            #[unroll]
            for m in 0..m_tiles {
                let tile = comptime!(m * out_tiles + tiles * 2 + half);
                let mut acc = load_acc(&*acc_regs, tile);
                def.execute_inplace(
                    &operand::<E>(a, comptime!(m * 4), 4usize),
                    &operand::<E>(&b, comptime!(half * 2), 2usize),
                    &mut acc,
                );
                store_acc(&acc, acc_regs, tile);
            }
        }
    }
}

/// `accum += Gᵀ · owned` for this plane's staged rows and columns: exchange slot
/// [`grads_slot`] of `scratch` holds `G` (owned × staged, swizzled, `cfg.block_kv` wide),
/// `owned` the owned rows (`cfg.head_dim` wide). Each group of split planes takes
/// `cfg.dq_plane_rows()` staged rows, each of its planes its part of the head dim (all of it
/// without a split), `cfg.dq_chunk_cols()` columns at a time; each chunk goes through the
/// plane's region of `staging` to [`add_rows`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn transposed_product<E: Float, N: Size>(
    scratch: &Shared<[E]>,
    owned: &Shared<[E]>,
    staging: &mut Shared<[f32]>,
    accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
    accum_base: usize,
    staged_start: usize,
    staged_len: usize,
    #[comptime] cfg: TileConfig,
) {
    let def = definition::<E>();
    let slot = comptime!(grads_slot(&cfg));
    let plane_rows = comptime!(cfg.dq_plane_rows());
    let m_tiles = comptime!(plane_rows / MMA_M);
    let part_cols = comptime!(cfg.head_dim / cfg.split);
    let chunk_cols = comptime!(cfg.dq_chunk_cols());
    let out_tiles = comptime!(chunk_cols / MMA_N);
    let lane = UNIT_POS_X as usize;
    let plane_first = UNIT_POS_Y as usize / cfg.split * plane_rows;
    let part_col = plane_part(cfg) * part_cols;
    let owned_pitch = comptime!(Pitch::rows(cfg.head_stride()));
    let (part_base, part_chunk) = part_start(part_cols, owned_pitch, cfg);
    // ldmatrix.x4.trans on G rows: lane l addresses owned row l / 16 · 8 + l % 8 at the 8 staged
    // columns (l / 8) % 2, giving the matrices (staged +0, owned +0), (+8, +0), (+0, +8),
    // (+8, +8): the A operand of one 16-deep step of Gᵀ.
    let g_row = lane / 16usize * 8usize + lane % 8usize;
    let g_chunk = lane / 8usize % 2usize;
    #[unroll]
    for part in 0..part_cols / chunk_cols {
        let mut acc_regs = Array::<f32>::new(comptime!(m_tiles * out_tiles * 4));
        #[unroll]
        for reg in 0..m_tiles * out_tiles * 4 {
            acc_regs[reg] = 0.0;
        }
        #[unroll]
        for step in 0..cfg.block_q / MMA_K {
            let mut a = Array::<Pair<E>>::new(comptime!(m_tiles * 4));
            #[unroll]
            for m in 0..m_tiles {
                let at = swizzled_offset(
                    0usize,
                    g_row,
                    (plane_first + comptime!(m * MMA_M)) / CHUNK + g_chunk,
                    comptime!(slot * cfg.block_q + step * MMA_K),
                    0usize,
                    comptime!(Pitch::rows(cfg.block_kv)),
                );
                let fragment = def.load_matrix::<E, Const<2>>(
                    scratch.slice(at, at + CHUNK),
                    MatrixIdent::A,
                    4usize,
                    true,
                );
                #[unroll]
                for i in 0..4usize {
                    a[comptime!(m * 4 + i)] = fragment[i];
                }
            }
            rows_product::<E>(
                &a,
                owned,
                part_base,
                part_chunk,
                &mut acc_regs,
                comptime!(step * MMA_K),
                comptime!(part * chunk_cols),
                chunk_cols,
                owned_pitch,
                m_tiles,
            );
        }
        if comptime!(part > 0) {
            // The plane's lanes are done reading the previous chunk's rows.
            sync_plane();
        }
        add_rows::<E, N>(
            &acc_regs,
            staging,
            accum,
            accum_base + part_col + comptime!(part * chunk_cols),
            staged_start + plane_first,
            staged_len,
            cfg,
        );
    }
}

/// Add this plane's accumulator tiles `regs` (`cfg.dq_plane_rows()` rows, `cfg.dq_chunk_cols()`
/// columns) to rows `row0..` of `accum` (`cfg.head_dim` wide, from column `accum_base` of its
/// row 0), skipping rows at or past `staged_len`. A lane holds pairs of columns of rows g and
/// g + 8 of each tile: atomics from there would each touch 8 rows. The plane writes its tiles
/// to its region of `staging` and reads them back as whole rows, so that each atomic adds `N`
/// adjacent columns and each plane-wide one covers whole rows (`float4` atomics where the
/// runtime has them: 2 rows of 64 columns per instruction).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_rows<E: Float, N: Size>(
    regs: &Array<f32>,
    staging: &mut Shared<[f32]>,
    accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
    accum_base: usize,
    row0: usize,
    staged_len: usize,
    #[comptime] cfg: TileConfig,
) {
    let rows = comptime!(cfg.dq_plane_rows());
    let cols = comptime!(cfg.dq_chunk_cols());
    let stride = comptime!(cols + 8);
    let out_tiles = comptime!(cols / MMA_N);
    let len = comptime!(cfg.dq_stage_elems());
    // Indices in vectors, each a lane term plus a constant, so that the constants fold into
    // the instructions' offsets.
    let region = UNIT_POS_Y as usize * comptime!(rows * stride);
    {
        let (lane_row, lane_col) = acc_position::<E>(0usize);
        let lane_pair = (region + lane_row * stride + lane_col) / 2;
        let pairs = staging
            .slice_mut(0, len)
            .as_vectorized_mut()
            .with_vector_size_mut::<Const<2>>();
        #[unroll]
        for m in 0..rows / MMA_M {
            #[unroll]
            for tile in 0..out_tiles {
                #[unroll]
                for half in 0..2usize {
                    let reg = comptime!((m * out_tiles + tile) * 4 + half * 2);
                    pairs[lane_pair
                        + comptime!(((m * MMA_M + half * 8) * stride + tile * MMA_N) / 2)] =
                        pair::<f32>(regs[reg], regs[comptime!(reg + 1)]);
                }
            }
        }
    }
    sync_plane();
    // Lane l reads 4 columns of row l / (cols / 4) per pass; the plane covers 32 · 4 / cols rows
    // per pass.
    let quads_per_row = comptime!(cols / 4);
    let rows_per_pass = comptime!(32 / quads_per_row);
    let lane = UNIT_POS_X as usize;
    let pass_row = lane / quads_per_row;
    let col = lane % quads_per_row * 4;
    let width = N::value();
    let quads = staging
        .slice(0, len)
        .as_vectorized()
        .with_vector_size::<Const<4>>();
    let lane_quad = (region + pass_row * stride + col) / 4;
    let lane_first = (accum_base + (row0 + pass_row) * cfg.head_dim + col) / width;
    #[unroll]
    for pass in 0..rows / rows_per_pass {
        let quad = quads[lane_quad + comptime!(pass * rows_per_pass * stride / 4)];
        if row0 + pass_row + comptime!(pass * rows_per_pass) < staged_len {
            let first = lane_first + comptime!(pass * rows_per_pass * cfg.head_dim / width);
            #[unroll]
            for i in 0..comptime!(4 / width) {
                let mut sum = Vector::<f32, N>::empty();
                #[unroll]
                for j in 0..comptime!(width) {
                    sum.insert(j, quad.extract(comptime!(i * width + j)));
                }
                #[comptime]
                if let ComptimeOption::Some(accum) = accum {
                    accum[first + i].fetch_add(sum);
                }
            }
        }
    }
}

/// `out += Xᵀ·values` for this plane's part of the accumulator columns over the whole staged
/// block, `X` being the group's block published to exchange slot `slot` (the A operand rows are
/// the group's owned rows) and `values` the staged block at `stage_base`.
#[cube]
fn exchange_product<E: Float>(
    exchange: &Shared<[E]>,
    #[comptime] slot: usize,
    values: &Shared<[E]>,
    stage_base: usize,
    out: &mut Array<f32>,
    #[comptime] cfg: TileConfig,
) {
    let m_tiles = comptime!(cfg.m_tiles());
    let pitch = comptime!(cfg.staged_pitch(cfg.value_stride()));
    let (part_base, part_chunk) = part_start(cfg.out_cols(), pitch, cfg);
    let values_base = stage_base + part_base;
    #[unroll]
    for step in 0..cfg.block_kv / MMA_K {
        let mut p = Array::<Pair<E>>::new(m_tiles * 4);
        #[unroll]
        for m in 0..m_tiles {
            let fragment = row_fragment::<E>(
                exchange,
                comptime!(slot * cfg.block_q),
                m,
                step,
                cfg.block_kv,
                cfg,
            );
            #[unroll]
            for i in 0..4usize {
                p[comptime!(m * 4 + i)] = fragment[i];
            }
        }
        rows_product::<E>(
            &p,
            values,
            values_base,
            part_chunk,
            out,
            comptime!(step * MMA_K),
            0usize,
            cfg.out_cols(),
            pitch,
            m_tiles,
        );
    }
}

/// Where this plane's part of the staged rows starts in the block at `stage_base` (whole 8-row
/// swizzle periods; the block itself without a split).
#[cube]
fn score_part_base(stage_base: usize, #[comptime] cfg: TileConfig) -> usize {
    let pitch = comptime!(cfg.staged_pitch(cfg.head_stride()));
    stage_base + plane_part(cfg) * comptime!(cfg.score_cols() * pitch.row)
}

/// `scores += Q·Kᵀ` for this plane's part of the staged rows, from `stage_base`
/// ([`score_part_base`]).
#[cube]
fn add_part_scores<E: Float>(
    query: &MmaQuery<E>,
    keys: &Shared<[E]>,
    stage_base: usize,
    scores: &mut Array<f32>,
    #[comptime] cfg: TileConfig,
) {
    let def = definition::<E>();
    let m_tiles = comptime!(cfg.m_tiles());
    let n_tiles = comptime!(cfg.score_cols() / MMA_N);
    let pitch = comptime!(cfg.staged_pitch(cfg.head_stride()));
    // ldmatrix.x4 on K rows: lane l addresses key row l % 8 of the n-tile at 8-column chunk
    // l / 8, giving the B operands of two consecutive 16-deep steps.
    let lane = UNIT_POS_X as usize;
    let key_row = lane % 8usize;
    let lane_chunk = lane / 8usize;
    #[unroll]
    for steps in 0..cfg.head_dim / (2 * MMA_K) {
        // A operands of both steps for every m16 block: (m · 2 + s) · 4.
        let mut a = Array::<Pair<E>>::new(m_tiles * 8);
        #[unroll]
        for m in 0..m_tiles {
            #[unroll]
            for s in 0..2usize {
                let fragment = query_operand::<E>(query, m, comptime!(steps * 2 + s), cfg);
                #[unroll]
                for i in 0..4usize {
                    a[comptime!((m * 2 + s) * 4 + i)] = fragment[i];
                }
            }
        }
        #[unroll]
        for tile in 0..n_tiles {
            let at = swizzled_offset(
                stage_base,
                key_row,
                lane_chunk,
                comptime!(tile * MMA_N),
                comptime!(steps * 2 * MMA_K / CHUNK),
                pitch,
            );
            let b = def.load_matrix::<E, Const<2>>(
                keys.slice(at, at + CHUNK),
                MatrixIdent::B,
                4usize,
                false,
            );
            #[unroll]
            for m in 0..m_tiles {
                let acc_tile = comptime!(m * n_tiles + tile);
                let mut acc = load_acc(&*scores, acc_tile);
                #[unroll]
                for s in 0..2usize {
                    def.execute_inplace(
                        &operand::<E>(&a, comptime!((m * 2 + s) * 4), 4usize),
                        &operand::<E>(&b, comptime!(s * 2), 2usize),
                        &mut acc,
                    );
                }
                store_acc(&acc, scores, acc_tile);
            }
        }
    }
}

/// Shared memory for one owned block (`cfg.block_q` rows, swizzled like the stages).
#[cube]
fn query_stage<E: Float>(#[comptime] cfg: TileConfig) -> Shared<[E]> {
    Shared::<[E]>::new_aligned_slice(comptime!(cfg.block_q * cfg.head_stride()), SMEM_ALIGN)
}

/// Issue the copies of the owned block of `cfg.block_q` rows from `start` into `stage`.
#[cube]
fn copy_owned<E: Float>(
    src: &Tensor<E>,
    head_base: usize,
    row_stride: usize,
    start: usize,
    seq: usize,
    stage: &mut Shared<[E]>,
    #[comptime] cfg: TileConfig,
) {
    copy_block_async::<E>(
        src,
        head_base,
        row_stride,
        start,
        seq,
        stage,
        0,
        cfg.block_q,
        cfg.head_dim,
        cfg,
    );
}

/// The owned block copied into `stage`, with the plane's A fragments read into registers unless
/// `cfg.query_in_smem()`. The copies must have landed.
#[cube]
fn query_fragments<E: Float>(stage: Shared<[E]>, #[comptime] cfg: TileConfig) -> MmaQuery<E> {
    let steps = comptime!(cfg.head_dim / MMA_K);
    let held = comptime!(if cfg.query_in_smem() {
        1
    } else {
        cfg.m_tiles() * steps * 4
    });
    let mut regs = Array::<Pair<E>>::new(held);
    if comptime!(!cfg.query_in_smem()) {
        #[unroll]
        for m in 0..cfg.m_tiles() {
            #[unroll]
            for step in 0..steps {
                let fragment =
                    row_fragment::<E>(&stage, 0usize, m, step, comptime!(cfg.head_stride()), cfg);
                #[unroll]
                for i in 0..4usize {
                    regs[comptime!((m * steps + step) * 4 + i)] = fragment[i];
                }
            }
        }
    }
    MmaQuery::<E> { stage, regs }
}

#[cube]
impl<E: Float> AttentionTile<E> for MmaTile {
    type Query = MmaQuery<E>;
    type StagedFactor = MmaStagedFactor<E>;

    fn load_query(
        q: &Tensor<E>,
        head_base: usize,
        row_stride: usize,
        q_start: usize,
        seq_q: usize,
        #[comptime] cfg: TileConfig,
    ) -> MmaQuery<E> {
        let mut stage = query_stage::<E>(cfg);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        sync_cube();
        copy_owned::<E>(q, head_base, row_stride, q_start, seq_q, &mut stage, cfg);
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        query_fragments::<E>(stage, cfg)
    }

    fn load_query_pair(
        first: &Tensor<E>,
        first_base: usize,
        second: &Tensor<E>,
        second_base: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
        #[comptime] second_cfg: TileConfig,
    ) -> (MmaQuery<E>, MmaQuery<E>) {
        let mut first_stage = query_stage::<E>(cfg);
        let mut second_stage = query_stage::<E>(second_cfg);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        sync_cube();
        copy_owned::<E>(
            first,
            first_base,
            first.stride(2),
            start,
            seq,
            &mut first_stage,
            cfg,
        );
        copy_owned::<E>(
            second,
            second_base,
            second.stride(2),
            start,
            seq,
            &mut second_stage,
            second_cfg,
        );
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        (
            query_fragments::<E>(first_stage, cfg),
            query_fragments::<E>(second_stage, second_cfg),
        )
    }

    fn scores(
        query: &MmaQuery<E>,
        keys: &Shared<[E]>,
        stage_base: usize,
        #[comptime] cfg: TileConfig,
    ) -> Array<f32> {
        // Not `zero_scores` then `add_scores`: this order emits the forward's and the
        // deterministic launches' code as before the split, which ptxas schedules differently.
        let part_base = score_part_base(stage_base, cfg);
        let mut scores = zero_scores(cfg);
        add_part_scores::<E>(query, keys, part_base, &mut scores, cfg);
        scores
    }

    fn add_scores(
        query: &MmaQuery<E>,
        keys: &Shared<[E]>,
        stage_base: usize,
        scores: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    ) {
        let part_base = score_part_base(stage_base, cfg);
        add_part_scores::<E>(query, keys, part_base, scores, cfg);
    }

    fn accumulate(
        probs: &Array<f32>,
        values: &Shared<[E]>,
        stage_base: usize,
        out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    ) {
        let m_tiles = comptime!(cfg.m_tiles());
        let score_tiles = comptime!(cfg.block_kv / MMA_N);
        #[unroll]
        for step in 0..cfg.block_kv / MMA_K {
            // The S accumulators of n-tiles 2·step and 2·step + 1 of an m16 block are laid out
            // exactly as the A operand of a 16-deep step: (row g, row g + 8) of the first, then
            // of the second.
            let mut p = Array::<Pair<E>>::new(m_tiles * 4);
            #[unroll]
            for m in 0..m_tiles {
                #[unroll]
                for i in 0..4usize {
                    let reg = comptime!((m * score_tiles + 2 * step + i / 2) * 4 + (i % 2) * 2);
                    p[comptime!(m * 4 + i)] =
                        pair::<E>(E::cast_from(probs[reg]), E::cast_from(probs[reg + 1]));
                }
            }
            rows_product::<E>(
                &p,
                values,
                stage_base,
                0usize,
                out,
                comptime!(step * MMA_K),
                0usize,
                cfg.value_dim,
                comptime!(cfg.staged_pitch(cfg.value_stride())),
                m_tiles,
            );
        }
    }

    fn accumulate_split(
        probs: &Array<f32>,
        grads: &Array<f32>,
        exchange: &mut Shared<[E]>,
        second: &Shared<[E]>,
        second_base: usize,
        second_out: &mut Array<f32>,
        first: &Shared<[E]>,
        first_base: usize,
        first_out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
        #[comptime] key_cfg: TileConfig,
    ) {
        let grads_slot = comptime!(grads_slot(&cfg));
        publish::<E>(probs, exchange, 0usize, cfg);
        if comptime!(grads_slot > 0) {
            publish::<E>(grads, exchange, grads_slot, cfg);
        }
        sync_cube();
        exchange_product::<E>(&*exchange, 0usize, second, second_base, second_out, cfg);
        if comptime!(grads_slot == 0) {
            // One slot: every plane must be done reading P before dS replaces it.
            sync_cube();
            publish::<E>(grads, exchange, 0usize, cfg);
            sync_cube();
        }
        exchange_product::<E>(
            &*exchange, grads_slot, first, first_base, first_out, key_cfg,
        );
    }

    fn add_transposed_product<N: Size>(
        grads: &Array<f32>,
        owned: &MmaQuery<E>,
        scratch: &mut Shared<[E]>,
        staging: &mut Shared<[f32]>,
        accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
        accum_base: usize,
        staged_start: usize,
        staged_len: usize,
        #[comptime] cfg: TileConfig,
    ) {
        // Each plane reads the A operand of Gᵀ for its own staged rows over all owned rows from
        // the published G; split planes have published it already (`accumulate_split`).
        if comptime!(cfg.split == 1) {
            publish::<E>(grads, scratch, 0usize, cfg);
            sync_cube();
        }
        transposed_product::<E, N>(
            &*scratch,
            &owned.stage,
            staging,
            accum,
            accum_base,
            staged_start,
            staged_len,
            cfg,
        );
    }

    fn store_owned(
        owned: &mut MmaQuery<E>,
        regs: &Array<f32>,
        factor: f32,
        out: &mut Tensor<E>,
        head_base: usize,
        row_stride: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
    ) {
        let stride = comptime!(cfg.value_stride());
        // Every plane is done reading the owned block (the last staged block's products).
        sync_cube();
        write_tile::<E>(
            regs,
            factor,
            &mut owned.stage,
            0usize,
            cfg.out_cols(),
            stride,
            cfg,
        );
        sync_cube();
        // The units walk the block's 16-byte chunks in row order: a plane writes whole rows.
        let chunks_per_row = comptime!(cfg.value_dim / CHUNK);
        let chunks = comptime!(cfg.block_q * chunks_per_row);
        let units = comptime!(cfg.units());
        #[unroll]
        for pass in 0..comptime!(chunks.div_ceil(units)) {
            let id = comptime!(pass * units) + UNIT_POS as usize;
            let row = id / chunks_per_row;
            let chunk = id % chunks_per_row;
            if id < chunks && start + row < seq {
                let at = stage_offset(row, chunk * CHUNK, stride, true);
                let to = head_base + (start + row) * row_stride + chunk * CHUNK;
                let dst = out
                    .slice_mut(to, to + CHUNK)
                    .as_vectorized_mut()
                    .with_vector_size_mut::<Const<CHUNK>>();
                dst[0] = owned
                    .stage
                    .slice(at, at + CHUNK)
                    .as_vectorized()
                    .with_vector_size::<Const<CHUNK>>()[0];
            }
        }
    }

    fn staged_factor(factor: f32, #[comptime] cfg: TileConfig) -> MmaStagedFactor<E> {
        let def = definition::<E>();
        let value = E::cast_from(factor);
        let mut diagonals = Array::<Pair<E>>::new(4usize);
        if comptime!(cfg.staged.bias_mma()) {
            #[unroll]
            for half in 0..2usize {
                #[unroll]
                for reg in 0..2usize {
                    let mut diagonal = Pair::<E>::empty();
                    #[unroll]
                    for e in 0..2usize {
                        let (k, n) = def.position_of_nth(
                            UNIT_POS_X,
                            comptime!((reg * 2 + e) as u32),
                            MatrixIdent::B,
                        );
                        diagonal.insert(
                            e,
                            select(k == n + comptime!(half as u32 * 8), value, E::new(0.0)),
                        );
                    }
                    diagonals[comptime!(half * 2 + reg)] = diagonal;
                }
            }
        }
        MmaStagedFactor::<E> {
            value: factor,
            diagonals,
            floor: pair::<E>(E::min_value(), E::min_value()),
        }
    }

    fn add_staged(
        scores: &mut Array<f32>,
        stage: &Shared<[E]>,
        base: usize,
        factor: &MmaStagedFactor<E>,
        #[comptime] cfg: TileConfig,
    ) {
        // ldmatrix.x4 as for a query fragment: the A fragment of a 16 × 16 block holds, in
        // order, the accumulator pairs (row g, row g + 8) of its two n-tiles.
        let def = definition::<E>();
        let lane = UNIT_POS_X as usize;
        let lane_row = group_row(cfg) + lane % 16usize;
        let n_tiles = comptime!(cfg.block_kv / MMA_N);
        #[unroll]
        for m in 0..cfg.m_tiles() {
            #[unroll]
            for pair in 0..n_tiles / 2 {
                let at = swizzled_offset(
                    base,
                    lane_row,
                    lane / 16usize,
                    comptime!(m * MMA_M),
                    comptime!(pair * 2),
                    comptime!(Pitch::rows(cfg.block_kv)),
                );
                let fragment = def.load_matrix::<E, Const<2>>(
                    stage.slice(at, at + CHUNK),
                    MatrixIdent::A,
                    4usize,
                    false,
                );
                if comptime!(cfg.staged.bias_mma()) {
                    let mut bias = Array::<Pair<E>>::new(4usize);
                    #[unroll]
                    for i in 0..4usize {
                        bias[i] = max(fragment[i], factor.floor);
                    }
                    #[unroll]
                    for half in 0..2usize {
                        let acc_tile = comptime!(m * n_tiles + pair * 2 + half);
                        let mut acc = load_acc(&*scores, acc_tile);
                        def.execute_inplace(
                            &bias,
                            &operand::<E>(&factor.diagonals, comptime!(half * 2), 2usize),
                            &mut acc,
                        );
                        store_acc(&acc, scores, acc_tile);
                    }
                } else {
                    #[unroll]
                    for i in 0..4usize {
                        let reg = comptime!((m * n_tiles + pair * 2 + i / 2) * 4 + i % 2 * 2);
                        scores[reg] += f32::cast_from(fragment[i].extract(0usize)) * factor.value;
                        scores[comptime!(reg + 1)] +=
                            f32::cast_from(fragment[i].extract(1usize)) * factor.value;
                    }
                }
            }
        }
    }

    fn score_position(#[comptime] reg: usize, #[comptime] cfg: TileConfig) -> (usize, usize) {
        acc_block_position::<E>(reg, cfg.score_cols(), cfg)
    }

    fn out_position(#[comptime] reg: usize, #[comptime] cfg: TileConfig) -> (usize, usize) {
        acc_block_position::<E>(reg, cfg.out_cols(), cfg)
    }

    fn slot_row(#[comptime] slot: usize, #[comptime] cfg: TileConfig) -> usize {
        // Slot 2m is row g of m16 block m, slot 2m + 1 row g + 8: accumulator element 0 or 2.
        let (row, _col) = acc_position::<E>(comptime!(slot % 2 * 2));
        group_row(cfg) + comptime!(slot / 2 * MMA_M) + row
    }

    fn writes_row_stats() -> bool {
        // The four lanes of a quad share rows g and g + 8.
        UNIT_POS_X % 4u32 == 0u32
    }

    fn row_max(value: f32) -> f32 {
        let value = max(value, plane_shuffle_xor(value, 1));
        max(value, plane_shuffle_xor(value, 2))
    }

    fn row_sum(value: f32) -> f32 {
        let value = value + plane_shuffle_xor(value, 1);
        value + plane_shuffle_xor(value, 2)
    }

    fn any_unit(flag: bool) -> bool {
        plane_any(flag)
    }
}
