//! The score inputs: broadcast views read in place, and a per-pair mask packed into bits and
//! its wholly hidden blocks, against what is computed here from the mask's values.

use super::{Rng, client};
use crate::kernel::pack::pack_mask;
use crate::kernel::{KernelTensor, ScoreInputs};

/// Expanded views keep their storage: a stride-0 dim becomes a broadcast dim of size 1, and
/// other views are copied into contiguous tensors.
#[test]
fn score_inputs_read_expanded_views_as_broadcasts() {
    let client = client();
    let values = Rng::new(7).normals(2 * 5);
    let source = KernelTensor::from_f32(&client, &values, [1, 2, 1, 5]);
    // [3, 2, 4, 5] expanded from [1, 2, 1, 5]: strides 0 on the broadcast dims.
    let expanded = KernelTensor::new(
        client.clone(),
        source.handle.clone(),
        [3, 2, 4, 5],
        [0, 5, 0, 1],
        source.dtype,
    );
    let inputs = ScoreInputs::new(None, Some(expanded));
    let bias = inputs.bias.unwrap();
    assert_eq!(bias.meta.shape()[..], [1, 2, 1, 5]);
    let memory = |t: &KernelTensor| format!("{:?}", t.handle.memory);
    assert_eq!(memory(&bias), memory(&source), "copied");
    assert_eq!(bias.read::<f32>(), values);

    // A transposed view has no stride 0: copied, dims kept.
    let transposed = KernelTensor::new(
        client.clone(),
        source.handle.clone(),
        [1, 1, 5, 2],
        [10, 10, 1, 5],
        source.dtype,
    );
    let bias = ScoreInputs::new(None, Some(transposed)).bias.unwrap();
    assert!(bias.is_contiguous());
    assert_eq!(bias.meta.shape()[..], [1, 1, 5, 2]);
    let expected: Vec<f32> = (0..10).map(|n| values[n % 2 * 5 + n / 2]).collect();
    assert_eq!(bias.read::<f32>(), expected);
}

/// Keys past a block's end, odd key counts (one element per load) and multiples of 4
/// (vectors), rows past the last query block, broadcasts; with documents (query i sees keys of
/// run i / 10 only, 30 % of those hidden at random), blocks the mask hides wholly.
#[test]
fn packs_a_bit_per_pair_by_kv_block() {
    let client = client();
    for &(dims, block_q, block_kv, documents) in &[
        ([2usize, 1, 70, 100], 32usize, 64usize, false),
        ([1, 3, 5, 33], 16, 32, false),
        ([1, 1, 128, 64], 128, 64, false),
        ([2, 2, 9, 256], 128, 128, false),
        ([1, 2, 100, 300], 16, 32, true),
        ([2, 1, 70, 333], 32, 64, true),
    ] {
        let [_, _, sq, sk] = dims;
        let mut rng = Rng::new((sq * 1000 + sk) as u64);
        let values: Vec<bool> = (0..dims.iter().product::<usize>())
            .map(|n| rng.uniform() < 0.3 || (documents && (n / sk % sq) / 10 != (n % sk) / 37))
            .collect();
        let words: Vec<u32> = values.iter().map(|&hidden| u32::from(hidden)).collect();
        let mask = KernelTensor::from_values(&client, &words, dims);
        let inputs = ScoreInputs::new(Some(mask), None);
        let packed = pack_mask(inputs.mask.as_ref().unwrap(), block_q, block_kv);
        let read = |t: KernelTensor| (t.meta.shape().to_vec(), t.read::<u32>());
        let (packed_dims, got) = read(packed.words);
        let (hidden_dims, hidden) = read(packed.hidden_blocks);

        let [b, h, _, _] = dims;
        let (words, blocks) = (block_kv / 32, sk.div_ceil(block_kv));
        let rows = sq.div_ceil(block_q) * block_q;
        assert_eq!(packed_dims[..], [b, h, blocks, rows * words]);
        let mut expected = Vec::with_capacity(got.len());
        for plane in 0..b * h {
            for block in 0..blocks {
                for row in 0..rows {
                    for word in 0..words {
                        let mut bits = 0u32;
                        for bit in 0..32 {
                            let key = block * block_kv + word * 32 + bit;
                            let hidden =
                                row >= sq || key >= sk || values[(plane * sq + row) * sk + key];
                            bits |= u32::from(hidden) << bit;
                        }
                        expected.push(bits);
                    }
                }
            }
        }
        assert_eq!(got, expected, "mask {dims:?}, blocks {block_q}×{block_kv}");

        // A block is hidden when no query row of it below `sq` sees a key below `sk`; each
        // row of flags ends with the first visible block and one past the last.
        let q_blocks = rows / block_q;
        assert_eq!(hidden_dims[..], [b, h, q_blocks, blocks + 2]);
        let mut expected_hidden = Vec::new();
        for plane in 0..b * h {
            for q_block in 0..q_blocks {
                let flags: Vec<u32> = (0..blocks)
                    .map(|block| {
                        let sees = |row: usize| {
                            (0..block_kv)
                                .map(|col| block * block_kv + col)
                                .any(|key| key < sk && !values[(plane * sq + row) * sk + key])
                        };
                        let all = !(q_block * block_q..(q_block + 1) * block_q)
                            .any(|row| row < sq && sees(row));
                        u32::from(all)
                    })
                    .collect();
                let visible = || (0..blocks).filter(|&block| flags[block] == 0);
                let first = visible().next().unwrap_or(blocks);
                let end = visible().next_back().map_or(0, |block| block + 1);
                expected_hidden.extend(flags.iter().copied());
                expected_hidden.extend([first as u32, end as u32]);
            }
        }
        assert_eq!(hidden, expected_hidden, "mask {dims:?}, hidden blocks");
    }
}
