//! Test helpers shared by the transports' unit tests: an all-gather whose body runs an injected
//! fault on one rank before its data phase, or any body in place of the ring algorithm, issued
//! straight to the engine.

use std::time::Duration;

use fsdp_device::{Buffer, DType, Device};

use super::algo::{self, Chunks};
use super::{Body, DataError, Engine};
use crate::flavors::check::Placement;
use crate::flavors::desc::OpDesc;
use crate::Result;

/// Issue a 64-element f32 all-gather of `world` ranks on `engine` (backend `backend`), in
/// 4-element segments; on `faulty` the body first runs `fault`, whose error (if any) fails the
/// data phase. The result of waiting up to `wait` for it.
pub(crate) fn faulty_all_gather(
    engine: &Engine,
    backend: &'static str,
    rank: usize,
    world: usize,
    faulty: usize,
    fault: impl FnOnce() -> std::result::Result<(), DataError> + Send + 'static,
    wait: Duration,
) -> Result<()> {
    let input = Buffer::from_slice(&[1.0f32; 64]).unwrap();
    let output = Buffer::zeros(DType::F32, 64 * world).unwrap();
    let body: Body = Box::new(move |t, guards, ctx, _| {
        if rank == faulty {
            fault()?;
        }
        let chunks = Chunks::equal(world, 64, 4);
        // SAFETY: the guards are the input's and the output's, held for the whole collective
        // (as in `all_gather_base`); the chunks cover exactly the 64 elements of each rank.
        unsafe { algo::all_gather::<f32>(t, ctx, guards[0].as_ptr(), guards[1].as_ptr(), &chunks) }
    });
    all_gather_with_body(
        engine,
        backend,
        (rank, world),
        (&input, &output),
        body,
        wait,
    )
}

/// Issue an f32 all-gather of `world` ranks from `input` into `output` (`world` times as long)
/// on `engine` (backend `backend`), with `body` as its data phase (`guards[0]` is the input's,
/// `guards[1]` the output's). The result of waiting up to `wait` for it.
pub(crate) fn all_gather_with_body(
    engine: &Engine,
    backend: &'static str,
    (rank, world): (usize, usize),
    (input, output): (&Buffer, &Buffer),
    body: Body,
    wait: Duration,
) -> Result<()> {
    let mut desc = OpDesc::new("all_gather_base");
    desc.dtype = Some(DType::F32);
    desc.count = input.len();
    let access = Placement::on(backend, Device::Cpu)
        .all_gather_base(rank, world, input, output)
        .unwrap();
    engine
        .issue(desc, Ok(access), body)
        .and_then(|w| w.wait_timeout(wait))
}
