//! The key/value history of one sequence: per layer, `len` rows of `kv_dim` keys and values.
//! Grows on demand up to the model's context length, so a short chat does not reserve the full
//! context up front.

pub struct KvCache {
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    pub kv_dim: usize,
    /// Positions stored (the same in every layer once a forward pass completes).
    pub len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize, kv_dim: usize) -> KvCache {
        KvCache {
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            kv_dim,
            len: 0,
        }
    }

    /// Forgets every position (keeps the allocation).
    pub fn clear(&mut self) {
        for k in &mut self.keys {
            k.clear();
        }
        for v in &mut self.values {
            v.clear();
        }
        self.len = 0;
    }

    /// Drops positions from `len` on (keeps the common prefix for reuse).
    pub fn truncate(&mut self, len: usize) {
        for k in &mut self.keys {
            k.truncate(len * self.kv_dim);
        }
        for v in &mut self.values {
            v.truncate(len * self.kv_dim);
        }
        self.len = self.len.min(len);
    }

    /// Bytes of KV memory per cached token (f32 keys and values over all layers).
    pub fn bytes_per_token(&self) -> usize {
        self.keys.len() * self.kv_dim * 2 * 4
    }
}
