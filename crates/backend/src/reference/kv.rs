//! The reference backend's KV cache, allocated once for the whole context.
//!
//! Values are held as f32, each rounded on write as a cache of its [`CacheType`] holds it
//! ([`CacheType::round`]: exact for f32, the nearest f16 for f16), so the oracle attends over exactly the
//! keys and values a fast backend's f16 cache gives back.
//!
//! Layout: keys and values each `[L, C, Hkv·D]` (layer-major, then position), C = context
//! length. Slot `p` of layer `l` holds the post-norm, post-RoPE key and the raw value of the
//! token at position `p`. Slots at or beyond the backend's position are stale and never read:
//! truncation only moves the position back, and the next append overwrites them.

use anyhow::{ensure, Context};
use nibble_model::kv_cache::CacheType;

/// Per-layer key/value storage for `context` positions.
pub struct KvCache {
    /// `[L, C, Hkv·D]`.
    keys: Vec<f32>,
    /// `[L, C, Hkv·D]`.
    values: Vec<f32>,
    context: usize,
    /// Hkv·D, the width of one cached position.
    row: usize,
    /// How each written element is rounded.
    kind: CacheType,
}

impl KvCache {
    /// Allocate `layers × context × row` keys and values, failing cleanly when that is too big.
    pub fn new(layers: usize, context: usize, row: usize, kind: CacheType) -> anyhow::Result<Self> {
        let n = layers
            .checked_mul(context)
            .and_then(|x| x.checked_mul(row))
            .context("KV cache size overflows")?;
        let alloc = |what: &str| -> anyhow::Result<Vec<f32>> {
            let mut v = Vec::new();
            v.try_reserve_exact(n).with_context(|| {
                format!(
                    "cannot allocate the {what} cache: {layers} layers x {context} positions x {row} \
                     f32 = {:.2} GiB",
                    n as f64 * 4.0 / (1u64 << 30) as f64
                )
            })?;
            v.resize(n, 0.0);
            Ok(v)
        };
        Ok(KvCache {
            keys: alloc("key")?,
            values: alloc("value")?,
            context,
            row,
            kind,
        })
    }

    /// Store the key and value `[Hkv·D]` of position `pos` in layer `layer`, each element
    /// rounded as the cache type holds it.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) -> anyhow::Result<()> {
        ensure!(
            pos < self.context,
            "KV write at {pos} beyond the context of {}",
            self.context
        );
        ensure!(
            k.len() == self.row && v.len() == self.row,
            "KV row of the wrong width"
        );
        let at = (layer * self.context + pos) * self.row;
        self.keys[at..at + self.row].copy_from_slice(k);
        self.values[at..at + self.row].copy_from_slice(v);
        self.kind.round_all(&mut self.keys[at..at + self.row]);
        self.kind.round_all(&mut self.values[at..at + self.row]);
        Ok(())
    }

    /// Keys and values `[n, Hkv·D]` of positions `0..n` in layer `layer`.
    pub fn layer(&self, layer: usize, n: usize) -> (&[f32], &[f32]) {
        let at = layer * self.context * self.row;
        let end = at + n.min(self.context) * self.row;
        (&self.keys[at..end], &self.values[at..end])
    }
}
