//! The SwiGLU MLP: `down(silu(gate x) * up x)`, for dense layers and shared experts.

use crate::error::Result;
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::Model;
use crate::ops;

pub(in crate::model) struct Mlp {
    pub(in crate::model) gate: Linear,
    pub(in crate::model) up: Linear,
    pub(in crate::model) down: Linear,
}

impl Mlp {
    /// `{prefix}.gate|up|down`.
    pub(in crate::model) fn load(
        t: &Tensors,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Mlp> {
        Ok(Mlp {
            gate: t.linear(&format!("{prefix}.gate"), inter, hidden)?,
            up: t.linear(&format!("{prefix}.up"), inter, hidden)?,
            down: t.linear(&format!("{prefix}.down"), hidden, inter)?,
        })
    }
}

impl Model {
    pub(in crate::model) fn mlp(&self, m: &Mlp, x: &mut Acts) -> Vec<f32> {
        let mut gu = self.project(&[m.gate, m.up], x);
        let up = gu.pop().unwrap();
        let mut g = gu.pop().unwrap();
        ops::swiglu(&mut g, &up, self.cfg.swiglu_limit);
        let mut hidden = Acts::from_vec(g, x.n, m.gate.rows);
        self.project(&[m.down], &mut hidden).remove(0)
    }
}
