//! The execution order the engine prefetches by (FSDP's `_ExecOrderData`): the order in which
//! units ran their pre-forward and post-forward hooks in the first pass, and per pass which
//! units have started forward and backward.

/// Recorded orders and the current pass's progress.
#[derive(Debug, Clone, Default)]
pub(crate) struct ExecOrder {
    /// Units in the order of their pre-forward hooks (recorded in the first pass).
    pre_forward: Option<Vec<usize>>,
    /// Units in the order of their post-forward hooks (recorded in the first pass).
    post_forward: Option<Vec<usize>>,
    recording_pre: Vec<usize>,
    recording_post: Vec<usize>,
    /// Units whose pre-forward hook ran in this pass.
    forward_started: Vec<bool>,
    /// Units whose pre-backward hook ran in this pass.
    backward_started: Vec<bool>,
}

impl ExecOrder {
    pub(crate) fn new(units: usize) -> Self {
        ExecOrder {
            forward_started: vec![false; units],
            backward_started: vec![false; units],
            ..ExecOrder::default()
        }
    }

    /// A new pass begins.
    pub(crate) fn begin_pass(&mut self) {
        self.forward_started.iter_mut().for_each(|b| *b = false);
        self.backward_started.iter_mut().for_each(|b| *b = false);
        self.recording_pre.clear();
        self.recording_post.clear();
    }

    pub(crate) fn on_pre_forward(&mut self, u: usize) {
        self.forward_started[u] = true;
        if self.pre_forward.is_none() {
            self.recording_pre.push(u);
        }
    }

    pub(crate) fn on_post_forward(&mut self, u: usize) {
        if self.post_forward.is_none() {
            self.recording_post.push(u);
        }
    }

    pub(crate) fn on_pre_backward(&mut self, u: usize) {
        self.backward_started[u] = true;
    }

    /// The forward pass ended: the first one's order is kept.
    pub(crate) fn end_forward(&mut self) {
        if self.pre_forward.is_none() && !self.recording_pre.is_empty() {
            self.pre_forward = Some(std::mem::take(&mut self.recording_pre));
            self.post_forward = Some(std::mem::take(&mut self.recording_post));
        }
    }

    /// The unit to prefetch in forward after `u`: the next unit of the recorded pre-forward
    /// order that has not started forward in this pass; before an order is recorded (the first
    /// pass), the next unit in definition order.
    pub(crate) fn next_forward(&self, u: usize) -> Option<usize> {
        match &self.pre_forward {
            Some(order) => {
                let pos = order.iter().position(|&x| x == u)?;
                order[pos + 1..]
                    .iter()
                    .copied()
                    .find(|&x| !self.forward_started[x])
            }
            None => (u + 1..self.forward_started.len()).find(|&x| !self.forward_started[x]),
        }
    }

    /// The unit to prefetch in backward after `u`: the next unit of the reversed post-forward
    /// order that has not started backward in this pass (none before an order is recorded).
    pub(crate) fn next_backward(&self, u: usize) -> Option<usize> {
        let order = self
            .post_forward
            .as_ref()
            .or((!self.recording_post.is_empty()).then_some(&self.recording_post))?;
        let pos = order.iter().position(|&x| x == u)?;
        order[..pos]
            .iter()
            .rev()
            .copied()
            .find(|&x| !self.backward_started[x])
    }
}
