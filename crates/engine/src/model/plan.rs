//! The tensors a model needs, under colibri's canonical names, and where each comes from in a
//! Hugging Face checkpoint. The per-family files fill a [`Plan`] (attention blocks add their own
//! tensors, see `layers/`); the converter follows it and the loader reads the same names back.

use crate::config::{FfnKind, ModelConfig};

/// Canonical names of the three matrices of an expert (and of any SwiGLU MLP).
pub const MLP_PARTS: [&str; 3] = ["gate", "up", "down"];

#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// colibri's name, e.g. `layers.3.q`.
    pub name: String,
    /// The checkpoint's name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub hf: String,
    pub shape: Vec<usize>,
    /// A weight matrix: stored at the model's quantization. Otherwise (norms, biases, routers)
    /// kept in f32.
    pub matrix: bool,
    /// Loaded if the checkpoint has it (attention biases).
    pub optional: bool,
    /// Made from per-head row blocks of the checkpoint tensor rather than taken whole.
    pub head_rows: Option<HeadRows>,
    /// Stored as `1 + w` (a zero-centred RMSNorm weight, Qwen3-Next's: the norm multiplies by
    /// `1 + w`, so the stored vector is what an ordinary RMSNorm multiplies by).
    pub plus_one: bool,
    /// An integer table (DeepSeek-V4's `tid2eid`): the checkpoint may hold it as I32 / I64,
    /// stored as exact f32.
    pub int_table: bool,
}

/// A tensor cut from per-head row blocks of a checkpoint tensor `[heads * per_head, cols]`:
/// rows `skip..skip + take` of every head's block, each block transposed or not. MLA's
/// `kv_b_proj` is stored this way as two matrices the kernels multiply directly: `W_uk^T`
/// (every head's key rows, transposed) and `W_uv` (every head's value rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadRows {
    pub heads: usize,
    pub per_head: usize,
    pub skip: usize,
    pub take: usize,
    /// Each head's `take x cols` block becomes `cols x take`.
    pub transpose: bool,
}

impl HeadRows {
    /// The output shape from a checkpoint tensor of `cols` columns.
    pub fn shape(&self, cols: usize) -> Vec<usize> {
        if self.transpose {
            vec![self.heads * cols, self.take]
        } else {
            vec![self.heads * self.take, cols]
        }
    }

    /// The output's values from the checkpoint tensor's (`[heads * per_head, cols]`, row-major).
    pub fn apply(&self, src: &[f32], cols: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.heads * self.take * cols);
        for h in 0..self.heads {
            let first = h * self.per_head + self.skip;
            let block = &src[first * cols..(first + self.take) * cols];
            if self.transpose {
                for c in 0..cols {
                    out.extend((0..self.take).map(|r| block[r * cols + c]));
                }
            } else {
                out.extend_from_slice(block);
            }
        }
        out
    }
}

impl TensorSpec {
    /// The checkpoint tensor's shape.
    pub fn source_shape(&self) -> Vec<usize> {
        match self.head_rows {
            None => self.shape.clone(),
            Some(hr) => {
                let cols = if hr.transpose {
                    self.shape[0] / hr.heads
                } else {
                    self.shape[1]
                };
                vec![hr.heads * hr.per_head, cols]
            }
        }
    }
}

/// Where one expert's gate/up/down come from in the checkpoint.
#[derive(Clone, Debug)]
pub struct ExpertSource {
    /// `model.layers.{i}.mlp.experts` — followed by either `.{e}.gate_proj.weight` (one tensor per
    /// expert, as published checkpoints store them) or `.gate_up_proj` / `.down_proj` (fused 3-D
    /// tensors `[E, 2*I, H]` with gate first, and `[E, H, I]`, as transformers 5 keeps them).
    pub prefix: String,
}

#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub resident: Vec<TensorSpec>,
    /// `(layer, source)` for every MoE layer, in layer order.
    pub expert_layers: Vec<(usize, ExpertSource)>,
}

impl Plan {
    fn add(&mut self, name: String, hf: String, shape: Vec<usize>, matrix: bool, optional: bool) {
        self.resident.push(TensorSpec {
            name,
            hf,
            shape,
            matrix,
            optional,
            head_rows: None,
            plus_one: false,
            int_table: false,
        });
    }
    /// A weight matrix cut from a checkpoint tensor of `cols` columns by `hr`.
    pub fn head_rows_matrix(&mut self, name: String, hf: String, hr: HeadRows, cols: usize) {
        self.resident.push(TensorSpec {
            name,
            hf,
            shape: hr.shape(cols),
            matrix: true,
            optional: false,
            head_rows: Some(hr),
            plus_one: false,
            int_table: false,
        });
    }
    /// A `[rows, cols]` matrix made from the plan's matrix `of` as stored, each of its
    /// An integer table `[rows, cols]` ([`TensorSpec::int_table`]), stored as f32.
    pub fn int_table(&mut self, name: String, hf: String, rows: usize, cols: usize) {
        self.add(name, hf, vec![rows, cols], false, false);
        self.resident.last_mut().expect("just added").int_table = true;
    }
    /// A zero-centred norm weight, stored as `1 + w` ([`TensorSpec::plus_one`]).
    pub fn vector_plus_one(&mut self, name: String, hf: String, n: usize) {
        self.vector(name, hf, n);
        self.resident.last_mut().expect("just added").plus_one = true;
    }
    /// A full-precision tensor of any shape (a convolution's weights).
    pub fn f32_tensor(&mut self, name: String, hf: String, shape: Vec<usize>) {
        self.add(name, hf, shape, false, false);
    }
    /// A weight matrix, stored at the model's quantization.
    pub fn matrix(&mut self, name: String, hf: String, rows: usize, cols: usize) {
        self.add(name, hf, vec![rows, cols], true, false);
    }
    pub fn vector(&mut self, name: String, hf: String, n: usize) {
        self.add(name, hf, vec![n], false, false);
    }
    pub fn optional_vector(&mut self, name: String, hf: String, n: usize) {
        self.add(name, hf, vec![n], false, true);
    }
    /// A full-precision matrix (a router).
    pub fn f32_matrix(&mut self, name: String, hf: String, rows: usize, cols: usize) {
        self.add(name, hf, vec![rows, cols], false, false);
    }
}

/// Embedding, final norm and output head: the same names in every supported family.
pub fn add_embeddings(p: &mut Plan, c: &ModelConfig) {
    p.matrix(
        "embed".into(),
        "model.embed_tokens.weight".into(),
        c.vocab_size,
        c.hidden_size,
    );
    p.vector("norm".into(), "model.norm.weight".into(), c.hidden_size);
    if !c.tie_word_embeddings {
        p.matrix(
            "lm_head".into(),
            "lm_head.weight".into(),
            c.vocab_size,
            c.hidden_size,
        );
    }
}

/// The two RMSNorms of layer `i` (before attention, before the feed-forward block).
pub fn add_layer_norms(p: &mut Plan, c: &ModelConfig, i: usize) {
    let h = c.hidden_size;
    p.vector(
        format!("layers.{i}.attn_norm"),
        format!("model.layers.{i}.input_layernorm.weight"),
        h,
    );
    p.vector(
        format!("layers.{i}.ffn_norm"),
        format!("model.layers.{i}.post_attention_layernorm.weight"),
        h,
    );
}

/// The plan of a family with no tensors of its own: embeddings, then per layer its norms, its
/// attention block and its feed-forward block.
pub fn standard(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    add_embeddings(&mut p, c);
    for i in 0..c.num_layers {
        add_layer_norms(&mut p, c, i);
        super::layers::plan_attention(&mut p, c, i);
        add_ffn(&mut p, c, i);
    }
    p
}

/// A SwiGLU MLP: canonical `{name}.gate|up|down` from `{hf_prefix}.gate_proj.weight` etc.
pub fn add_mlp(p: &mut Plan, name: &str, hf_prefix: &str, hidden: usize, inter: usize) {
    p.matrix(
        format!("{name}.gate"),
        format!("{hf_prefix}.gate_proj.weight"),
        inter,
        hidden,
    );
    p.matrix(
        format!("{name}.up"),
        format!("{hf_prefix}.up_proj.weight"),
        inter,
        hidden,
    );
    p.matrix(
        format!("{name}.down"),
        format!("{hf_prefix}.down_proj.weight"),
        hidden,
        inter,
    );
}

/// The feed-forward block of layer `i`: a dense MLP, or a router plus routed experts.
pub fn add_ffn(p: &mut Plan, c: &ModelConfig, i: usize) {
    match c.layers[i] {
        FfnKind::Dense => add_mlp(
            p,
            &format!("layers.{i}.mlp"),
            &format!("model.layers.{i}.mlp"),
            c.hidden_size,
            c.intermediate_size,
        ),
        FfnKind::Moe => {
            p.f32_matrix(
                format!("layers.{i}.router"),
                format!("model.layers.{i}.mlp.gate.weight"),
                c.num_experts,
                c.hidden_size,
            );
            p.expert_layers.push((
                i,
                ExpertSource {
                    prefix: format!("model.layers.{i}.mlp.experts"),
                },
            ));
        }
    }
}

/// Names of checkpoint tensors that are deliberately not converted, with the reason.
pub fn skip_reason(c: &ModelConfig, hf: &str) -> Option<String> {
    if hf.ends_with("rotary_emb.inv_freq") {
        return Some("recomputed from config".into());
    }
    if hf.starts_with("model.mtp.") || hf.starts_with("mtp.") {
        return Some("multi-token-prediction head, not used".into());
    }
    let layer: Option<usize> = hf
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|s| s.parse().ok());
    match layer {
        Some(l) if l >= c.num_layers => Some(format!(
            "layer {l} is past num_hidden_layers (multi-token-prediction head, not used)"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::HeadRows;

    /// Two heads of 3 rows over 2 columns: rows 1..3 of each head, transposed and not.
    #[test]
    fn head_rows_cut_and_transpose_each_heads_block() {
        let src: Vec<f32> = (0..12).map(|x| x as f32).collect(); // [6, 2]
        let hr = |transpose| HeadRows {
            heads: 2,
            per_head: 3,
            skip: 1,
            take: 2,
            transpose,
        };
        assert_eq!(hr(false).shape(2), vec![4, 2]);
        assert_eq!(hr(false).apply(&src, 2), [2., 3., 4., 5., 8., 9., 10., 11.]);
        assert_eq!(hr(true).shape(2), vec![4, 2]);
        assert_eq!(hr(true).apply(&src, 2), [2., 4., 3., 5., 8., 10., 9., 11.]);
    }
}
