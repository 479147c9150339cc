//! The tensor-core tile: m16n8k16 `mma.sync` through CubeCL's `MmaDefinition`, operands read
//! from the swizzled K/V stages with `ldmatrix`. Each plane owns 16 query rows; its Q fragment
//! stays in registers for the whole KV loop, and P goes from the S accumulators straight into
//! the A operand of P·V without touching shared memory.

// The cube macro expands `%` itself; `is_multiple_of` has no kernel form.
#![allow(clippy::manual_is_multiple_of)]

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::AttentionTile;
use crate::kernel::config::{ForwardConfig, CHUNK, MMA_K, MMA_N, MMA_ROWS};
use crate::kernel::stage::stage_offset;

/// Two 16-bit values in one 32-bit register, or two f32 accumulators: the MMA register unit.
type Pair<T> = Vector<T, Const<2>>;

/// `mma.sync` tile. Unit (`UNIT_POS_X` = lane, `UNIT_POS_Y` = plane).
pub struct MmaTile;

#[cube]
fn definition<E: Float>() -> MmaDefinition<E, E, f32> {
    MmaDefinition::<E, E, f32>::new(MMA_ROWS, MMA_N, MMA_K)
}

/// The (row, column) of accumulator element `nth` (0..4) of this lane in an m16n8 tile.
#[cube]
fn acc_position<E: Float>(#[comptime] nth: usize) -> (usize, usize) {
    let (row, col) =
        definition::<E>().position_of_nth(UNIT_POS_X, nth as u32, MatrixIdent::Accumulator);
    (row as usize, col as usize)
}

#[cube]
fn pair<T: Float>(first: T, second: T) -> Pair<T> {
    let mut pair = Pair::<T>::empty();
    pair[0] = first;
    pair[1] = second;
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
    regs[tile * 4] = acc[0][0];
    regs[tile * 4 + 1] = acc[0][1];
    regs[tile * 4 + 2] = acc[1][0];
    regs[tile * 4 + 3] = acc[1][1];
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

#[cube]
impl<E: Float> AttentionTile<E> for MmaTile {
    /// A operands, 4 registers per 16-column step of the head dim.
    type Query = Array<Pair<E>>;

    fn load_query(
        q: &Tensor<E>,
        head_base: usize,
        q_start: usize,
        seq_q: usize,
        #[comptime] cfg: ForwardConfig,
    ) -> Array<Pair<E>> {
        let def = definition::<E>();
        let steps = comptime!(cfg.head_dim / MMA_K);
        let mut query = Array::<Pair<E>>::new(steps * 4usize);
        let plane_row = q_start + UNIT_POS_Y as usize * MMA_ROWS;
        let zero = E::new(0.0);
        #[unroll]
        for i in 0..4usize {
            let (row, col) = def.position_of_nth(UNIT_POS_X, (i * 2usize) as u32, MatrixIdent::A);
            let global_row = plane_row + row as usize;
            let in_bounds = global_row < seq_q;
            let start =
                head_base + select(in_bounds, global_row * q.stride(2), 0usize) + col as usize;
            #[unroll]
            for step in 0..steps {
                let at = start + step * MMA_K;
                query[step * 4usize + i] = pair::<E>(
                    select(in_bounds, q[at], zero),
                    select(in_bounds, q[at + 1usize], zero),
                );
            }
        }
        query
    }

    fn scores(
        query: &Array<Pair<E>>,
        keys: &SharedMemory<E>,
        stage_base: usize,
        #[comptime] cfg: ForwardConfig,
    ) -> Array<f32> {
        let def = definition::<E>();
        let mut scores = Array::<f32>::new(cfg.score_regs());
        // ldmatrix.x4 on K rows: lane l addresses key row l % 8 of the n-tile at 8-column chunk
        // l / 8, giving the B operands of two consecutive 16-deep steps.
        let lane = UNIT_POS_X as usize;
        let key_row = lane % 8usize;
        let chunk = lane / 8usize;
        #[unroll]
        for tile in 0..cfg.block_kv / MMA_N {
            let mut acc = Array::<Pair<f32>>::new(2usize);
            acc[0] = Pair::<f32>::new(0.0);
            acc[1] = Pair::<f32>::new(0.0);
            #[unroll]
            for step in 0..cfg.head_dim / (2 * MMA_K) {
                let at = stage_base
                    + stage_offset(
                        tile * MMA_N + key_row,
                        step * 2 * MMA_K + chunk * CHUNK,
                        cfg.head_dim,
                        true,
                    );
                let b = def.load_matrix::<E, Const<2>>(
                    &keys.slice(at, at + CHUNK),
                    MatrixIdent::B,
                    4usize,
                    false,
                );
                def.execute_inplace(
                    &operand::<E>(query, step * 8usize, 4usize),
                    &operand::<E>(&b, 0usize, 2usize),
                    &mut acc,
                );
                def.execute_inplace(
                    &operand::<E>(query, step * 8usize + 4usize, 4usize),
                    &operand::<E>(&b, 2usize, 2usize),
                    &mut acc,
                );
            }
            store_acc(&acc, &mut scores, tile);
        }
        scores
    }

    fn accumulate(
        probs: &Array<f32>,
        values: &SharedMemory<E>,
        stage_base: usize,
        out: &mut Array<f32>,
        #[comptime] cfg: ForwardConfig,
    ) {
        let def = definition::<E>();
        // ldmatrix.x4.trans on V rows: matrices (keys +0, cols +0), (keys +8, cols +0),
        // (keys +0, cols +8), (keys +8, cols +8) are the B operands of two n-tiles.
        let lane = UNIT_POS_X as usize;
        let key_row = (lane / 8usize) % 2usize * 8usize + lane % 8usize;
        let col = lane / 16usize * CHUNK;
        #[unroll]
        for step in 0..cfg.block_kv / MMA_K {
            // The S accumulators of n-tiles 2·step and 2·step + 1 are laid out exactly as the A
            // operand of a 16-deep step: (row g, row g + 8) of the first, then of the second.
            let mut p = Array::<Pair<E>>::new(4usize);
            #[unroll]
            for i in 0..4usize {
                let reg = comptime!((2 * step + i / 2) * 4 + (i % 2) * 2);
                p[i] = pair::<E>(E::cast_from(probs[reg]), E::cast_from(probs[reg + 1]));
            }
            #[unroll]
            for tiles in 0..cfg.value_dim / (2 * MMA_N) {
                let at = stage_base
                    + stage_offset(
                        step * MMA_K + key_row,
                        tiles * 2 * MMA_N + col,
                        cfg.value_dim,
                        true,
                    );
                let b = def.load_matrix::<E, Const<2>>(
                    &values.slice(at, at + CHUNK),
                    MatrixIdent::B,
                    4usize,
                    true,
                );
                #[unroll]
                for half in 0..2usize {
                    let tile = comptime!(tiles * 2 + half);
                    let mut acc = load_acc(out, tile);
                    def.execute_inplace(&p, &operand::<E>(&b, half * 2usize, 2usize), &mut acc);
                    store_acc(&acc, out, tile);
                }
            }
        }
    }

    fn score_position(#[comptime] reg: usize, #[comptime] _cfg: ForwardConfig) -> (usize, usize) {
        let (row, col) = acc_position::<E>(comptime!(reg % 4));
        (
            UNIT_POS_Y as usize * MMA_ROWS + row,
            comptime!(reg / 4 * MMA_N) + col,
        )
    }

    fn out_position(#[comptime] reg: usize, #[comptime] _cfg: ForwardConfig) -> (usize, usize) {
        let (row, col) = acc_position::<E>(comptime!(reg % 4));
        (
            UNIT_POS_Y as usize * MMA_ROWS + row,
            comptime!(reg / 4 * MMA_N) + col,
        )
    }

    fn slot_row(#[comptime] slot: usize, #[comptime] _cfg: ForwardConfig) -> usize {
        let (row, _col) = acc_position::<E>(comptime!(slot * 2));
        UNIT_POS_Y as usize * MMA_ROWS + row
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
}
