//! The corpus, its byte-level tokens, the train/validation split and the batches.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tokens are bytes.
pub const VOCAB_SIZE: usize = 256;

/// The split works on blocks of this many bytes, so that validation text comes from all over
/// the corpus rather than from its last files only.
const SPLIT_BLOCK: usize = 4096;

/// The bytes of `path`: a file, or every regular file under a directory (recursively, in path
/// order). Symbolic links are skipped (Debian's fortunes has `name.u8 -> name`), and so are
/// files containing a NUL byte (binary indexes such as fortunes' `.dat`).
pub fn load_corpus(path: &Path) -> io::Result<Vec<u8>> {
    if !path.is_dir() {
        return fs::read(path);
    }
    let mut files = Vec::new();
    collect_files(path, &mut files)?;
    files.sort();
    let mut corpus = Vec::new();
    for file in files {
        let bytes = fs::read(&file)?;
        if !bytes.contains(&0) {
            corpus.extend_from_slice(&bytes);
        }
    }
    Ok(corpus)
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            collect_files(&entry.path(), files)?;
        } else if kind.is_file() {
            files.push(entry.path());
        }
    }
    Ok(())
}

/// Text for display: bytes as UTF-8, invalid sequences replaced.
pub fn decode(tokens: &[u8]) -> String {
    String::from_utf8_lossy(tokens).into_owned()
}

/// Split the corpus into training and validation text: of consecutive blocks of
/// [`SPLIT_BLOCK`] bytes, an evenly spread `val_fraction` go to validation.
pub fn split(corpus: &[u8], val_fraction: f64) -> (Vec<u8>, Vec<u8>) {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, block) in corpus.chunks(SPLIT_BLOCK).enumerate() {
        // Block i is validation when the running count of validation blocks steps up at it.
        let step = ((i + 1) as f64 * val_fraction).floor() > (i as f64 * val_fraction).floor();
        if step { &mut val } else { &mut train }.extend_from_slice(block);
    }
    (train, val)
}

/// One batch: `inputs[b]` is a window of `context` tokens, `targets[b]` the same window one
/// token later. Row-major `[batch, context]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The input tokens, `batch × context`.
    pub inputs: Vec<i32>,
    /// The tokens to predict, each input's successor in the text.
    pub targets: Vec<i32>,
    /// Rows (sequences).
    pub batch: usize,
    /// Tokens per row.
    pub context: usize,
}

impl Batch {
    /// The batch's rows dealt into `parts` consecutive shards of equal size, one per device of
    /// data-parallel training. Panics unless `parts` divides the batch.
    pub fn shards(&self, parts: usize) -> Vec<Batch> {
        assert!(
            parts > 0 && self.batch.is_multiple_of(parts),
            "a batch of {} rows cannot be split in {parts}",
            self.batch
        );
        let rows = self.batch / parts;
        let len = rows * self.context;
        (0..parts)
            .map(|part| Batch {
                inputs: self.inputs[part * len..(part + 1) * len].to_vec(),
                targets: self.targets[part * len..(part + 1) * len].to_vec(),
                batch: rows,
                context: self.context,
            })
            .collect()
    }
}

/// Windows at random offsets of a text, from a seeded generator: the same seed gives the same
/// sequence of batches.
pub struct Batches<'a> {
    text: &'a [u8],
    batch: usize,
    context: usize,
    rng: StdRng,
}

impl<'a> Batches<'a> {
    /// Batches of `batch` windows of `context` tokens of `text`, drawn with `seed`.
    ///
    /// # Panics
    ///
    /// If the text is not longer than `context`.
    pub fn new(text: &'a [u8], batch: usize, context: usize, seed: u64) -> Self {
        assert!(
            text.len() > context,
            "the text ({} bytes) must be longer than the context ({context})",
            text.len()
        );
        Self {
            text,
            batch,
            context,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The next `batch` windows.
    pub fn next_batch(&mut self) -> Batch {
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..self.batch {
            let start = self.rng.random_range(0..self.text.len() - self.context);
            let window = &self.text[start..start + self.context + 1];
            inputs.extend(window[..self.context].iter().map(|&b| i32::from(b)));
            targets.extend(window[1..].iter().map(|&b| i32::from(b)));
        }
        Batch {
            inputs,
            targets,
            batch: self.batch,
            context: self.context,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let text: Vec<u8> = (0..=255).collect();
        let batch = Batches::new(&text, 3, 10, 7).next_batch();
        assert_eq!((batch.inputs.len(), batch.targets.len()), (30, 30));
        for row in 0..3 {
            let inputs = &batch.inputs[row * 10..row * 10 + 10];
            let targets = &batch.targets[row * 10..row * 10 + 10];
            // Consecutive bytes in this text: each target is its input plus one.
            assert!(inputs.iter().zip(targets).all(|(i, t)| t - i == 1));
            assert!(inputs.windows(2).all(|w| w[1] - w[0] == 1));
        }
    }

    #[test]
    fn batches_depend_on_the_seed_only() {
        let text = b"the quick brown fox jumps over the lazy dog, again and again".repeat(20);
        let draw = |seed| {
            let mut batches = Batches::new(&text, 4, 16, seed);
            [batches.next_batch(), batches.next_batch()]
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
        let [first, second] = draw(1);
        assert_ne!(first, second);
    }

    #[test]
    fn shards_deal_consecutive_rows() {
        let text: Vec<u8> = (0..=255).collect();
        let batch = Batches::new(&text, 6, 5, 3).next_batch();
        let shards = batch.shards(3);
        assert_eq!(shards.len(), 3);
        assert!(shards.iter().all(|s| s.batch == 2 && s.context == 5));
        let joined: Vec<i32> = shards.iter().flat_map(|s| s.inputs.clone()).collect();
        assert_eq!(joined, batch.inputs);
        let joined: Vec<i32> = shards.iter().flat_map(|s| s.targets.clone()).collect();
        assert_eq!(joined, batch.targets);
    }

    #[test]
    fn split_spreads_validation_blocks() {
        let corpus: Vec<u8> = (0..20 * SPLIT_BLOCK)
            .map(|i| (i / SPLIT_BLOCK) as u8)
            .collect();
        let (train, val) = split(&corpus, 0.1);
        assert_eq!(train.len() + val.len(), corpus.len());
        // Blocks 9 and 19 (the 10th and 20th) are validation.
        assert_eq!(val.len(), 2 * SPLIT_BLOCK);
        assert_eq!((val[0], val[SPLIT_BLOCK]), (9, 19));
        assert!(!train.contains(&9) && !train.contains(&19));
    }

    #[cfg(unix)]
    #[test]
    fn directories_skip_links_and_binary_files() {
        let dir = std::env::temp_dir().join(format!("gpt-corpus-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("b"), "second\n").unwrap();
        fs::write(dir.join("a"), "first\n").unwrap();
        fs::write(dir.join("a.dat"), [1, 0, 2]).unwrap();
        fs::write(dir.join("sub/c"), "third\n").unwrap();
        std::os::unix::fs::symlink(dir.join("a"), dir.join("a.u8")).unwrap();
        let corpus = load_corpus(&dir);
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(decode(&corpus.unwrap()), "first\nsecond\nthird\n");
    }
}
