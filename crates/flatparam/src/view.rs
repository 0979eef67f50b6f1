//! Shaped views of parameters inside flat buffers: borrowed slices, never copies.

use std::fmt;
use std::ops::{Deref, DerefMut};

use fsdp_device::Element;

use crate::layout::{ParamInfo, ShardParamInfo};

/// A read-only view of one parameter inside an unsharded flat buffer: the parameter's elements
/// in row-major order, with its name and shape. Derefs to `[T]`.
#[derive(Clone, Copy)]
pub struct ParamView<'a, T> {
    pub(crate) name: &'a str,
    pub(crate) info: &'a ParamInfo,
    pub(crate) index: usize,
    pub(crate) data: &'a [T],
}

impl<'a, T: Element> ParamView<'a, T> {
    /// The name the view was asked for (an alias's own name for a tied parameter).
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The parameter's shape.
    pub fn shape(&self) -> &'a [usize] {
        self.info.shape()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Index of the viewed parameter in [`FlatParamLayout::params`](crate::FlatParamLayout::params)
    /// (for an alias, the index of the parameter it shares).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The elements, borrowed for the whole life of the flat buffer's borrow.
    pub fn data(&self) -> &'a [T] {
        self.data
    }
}

impl<T> Deref for ParamView<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T: fmt::Debug> fmt::Debug for ParamView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamView")
            .field("name", &self.name)
            .field("shape", &self.info.shape())
            .field("data", &self.data)
            .finish()
    }
}

/// A mutable view of one parameter (or its gradient) inside an unsharded flat buffer. Views of
/// different parameters are disjoint, so they can be written at the same time — a backward pass
/// writes gradients straight into the flat gradient buffer. Derefs to `[T]`.
pub struct ParamViewMut<'a, T> {
    pub(crate) info: &'a ParamInfo,
    pub(crate) index: usize,
    pub(crate) data: &'a mut [T],
}

impl<'a, T: Element> ParamViewMut<'a, T> {
    /// The parameter's name.
    pub fn name(&self) -> &'a str {
        self.info.name()
    }

    /// The parameter's shape.
    pub fn shape(&self) -> &'a [usize] {
        self.info.shape()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Index of the parameter in [`FlatParamLayout::params`](crate::FlatParamLayout::params).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The elements, mutably, for the whole life of the flat buffer's borrow.
    pub fn into_data(self) -> &'a mut [T] {
        self.data
    }
}

impl<T> Deref for ParamViewMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T> DerefMut for ParamViewMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.data
    }
}

impl<T: fmt::Debug> fmt::Debug for ParamViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamViewMut")
            .field("name", &self.info.name())
            .field("shape", &self.info.shape())
            .field("data", &self.data)
            .finish()
    }
}

/// The piece of one parameter that lies in a rank's shard, viewed inside that shard: what a
/// sharded optimizer updates and a sharded checkpoint saves. Derefs to `[T]`.
#[derive(Clone, Copy)]
pub struct ShardParamView<'a, T> {
    pub(crate) info: &'a ParamInfo,
    pub(crate) index: usize,
    pub(crate) piece: ShardParamInfo,
    pub(crate) data: &'a [T],
}

impl<'a, T: Element> ShardParamView<'a, T> {
    /// The parameter's name.
    pub fn name(&self) -> &'a str {
        self.info.name()
    }

    /// The whole parameter's shape (the piece is a run of its flattened elements).
    pub fn shape(&self) -> &'a [usize] {
        self.info.shape()
    }

    /// Index of the parameter in [`FlatParamLayout::params`](crate::FlatParamLayout::params).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Where the piece lies in the shard and in the parameter.
    pub fn shard_param_info(&self) -> ShardParamInfo {
        self.piece
    }

    /// The piece's elements.
    pub fn data(&self) -> &'a [T] {
        self.data
    }
}

impl<T> Deref for ShardParamView<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T: fmt::Debug> fmt::Debug for ShardParamView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardParamView")
            .field("name", &self.info.name())
            .field("piece", &self.piece)
            .field("data", &self.data)
            .finish()
    }
}

/// The mutable counterpart of [`ShardParamView`]: disjoint pieces of one shard, for a sharded
/// optimizer's step. Derefs to `[T]`.
pub struct ShardParamViewMut<'a, T> {
    pub(crate) info: &'a ParamInfo,
    pub(crate) index: usize,
    pub(crate) piece: ShardParamInfo,
    pub(crate) data: &'a mut [T],
}

impl<'a, T: Element> ShardParamViewMut<'a, T> {
    /// The parameter's name.
    pub fn name(&self) -> &'a str {
        self.info.name()
    }

    /// The whole parameter's shape (the piece is a run of its flattened elements).
    pub fn shape(&self) -> &'a [usize] {
        self.info.shape()
    }

    /// Index of the parameter in [`FlatParamLayout::params`](crate::FlatParamLayout::params).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Where the piece lies in the shard and in the parameter.
    pub fn shard_param_info(&self) -> ShardParamInfo {
        self.piece
    }

    /// The piece's elements, mutably, for the whole life of the shard's borrow.
    pub fn into_data(self) -> &'a mut [T] {
        self.data
    }
}

impl<T> Deref for ShardParamViewMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T> DerefMut for ShardParamViewMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.data
    }
}

impl<T: fmt::Debug> fmt::Debug for ShardParamViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardParamViewMut")
            .field("name", &self.info.name())
            .field("piece", &self.piece)
            .field("data", &self.data)
            .finish()
    }
}
