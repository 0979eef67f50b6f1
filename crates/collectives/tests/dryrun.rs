//! The dry-run backend against the backends that move data: the same calls are accepted and the
//! same calls are refused with the same errors (on meta buffers as on host buffers), every
//! collective completes at once, and `dry_run_mesh` gives every rank the groups that `mesh_2d`
//! over a real group gives it.

use fsdp_collectives::dryrun::{dry_run_mesh, DryRunCommunicator};
use fsdp_collectives::{mesh_2d, ring, tcp, CollectiveError, Communicator};
use fsdp_device::{DType, Device};

mod support;
use support::*;

/// The invalid calls' errors as comparable text: the variant, rank, operation and reason.
fn describe(errors: &[(&'static str, CollectiveError)]) -> Vec<String> {
    errors
        .iter()
        .map(|(case, e)| match e {
            CollectiveError::InvalidArgument { rank, op, reason } => {
                format!("{case}: InvalidArgument rank {rank} {op}: {reason}")
            }
            other => panic!("{case}: expected an invalid-argument error, got {other:?}"),
        })
        .collect()
}

#[test]
fn invalid_calls_fail_as_on_the_ring_and_tcp_backends() {
    for world in [2, 3, 5] {
        let ring = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
            let errors = describe(&invalid_calls(&comm, &host_buffer));
            // The group stays usable after refused calls.
            for (name, work) in valid_calls(&comm, &host_buffer) {
                work.wait().unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            errors
        })
        .unwrap();
        let tcp = tcp::run_local_ranks(world, tcp::TcpOptions::default(), |comm| {
            describe(&invalid_calls(&comm, &host_buffer))
        })
        .unwrap();
        assert_eq!(ring, tcp, "world {world}");
        for (rank, want) in ring.iter().enumerate() {
            let dry = DryRunCommunicator::new(rank, world).unwrap();
            assert_eq!(&describe(&invalid_calls(&dry, &meta_buffer)), want);
            assert_eq!(&describe(&invalid_calls(&dry, &host_buffer)), want);
        }
    }
}

#[test]
fn every_collective_completes_at_once_on_any_device() {
    for world in [1, 2, 4] {
        for rank in 0..world {
            let comm = DryRunCommunicator::new(rank, world).unwrap();
            assert_eq!((comm.rank(), comm.world_size()), (rank, world));
            assert_eq!(comm.stream().device(), Device::Cpu);
            assert_eq!(comm.device(), Device::Cpu);
            for buf in [&meta_buffer as MakeBuffer<'_>, &host_buffer] {
                let calls = valid_calls(&comm, buf);
                assert_eq!(calls.len(), 4 * 2 * 8 + 1);
                for (name, work) in calls {
                    assert!(work.is_completed(), "{name}");
                    assert!(matches!(work.poll(), Some(Ok(()))), "{name}");
                    assert!(work.event().query(), "{name}");
                    work.wait_timeout(std::time::Duration::ZERO)
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    comm.stream().wait_event(work.event()).unwrap();
                }
            }
        }
    }
    // The same calls are valid on the ring (which also checks they agree across ranks).
    ring::run_ranks(3, ring::RingOptions::default(), |comm| {
        for (name, work) in valid_calls(&comm, &host_buffer) {
            work.wait().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    })
    .unwrap();
}

#[test]
fn the_dry_run_moves_no_data() {
    let comm = DryRunCommunicator::new(1, 2).unwrap();
    let input = fsdp_device::Buffer::from_slice(&[1.0f32, 2.0]).unwrap();
    let output = fsdp_device::Buffer::from_slice(&[9.0f32; 4]).unwrap();
    comm.all_gather_base(&input, &output)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(output.to_vec::<f32>().unwrap(), vec![9.0; 4]);
    // A meta buffer of any size costs nothing.
    let huge = fsdp_device::Buffer::meta(DType::F32, 1 << 45).unwrap();
    let work = comm
        .all_reduce(&huge, fsdp_collectives::ReduceOp::Sum)
        .unwrap();
    assert!(work.is_completed());
}

#[test]
fn dry_run_mesh_matches_mesh_2d_over_the_ring() {
    for (replicate, shard) in [(2, 2), (3, 2), (2, 3), (1, 4), (4, 1)] {
        let world = replicate * shard;
        let real = ring::run_ranks(world, ring::RingOptions::default(), |comm| {
            let mesh = mesh_2d(&comm, replicate, shard).unwrap();
            (
                mesh.shard.rank(),
                mesh.shard.world_size(),
                mesh.replicate.rank(),
                mesh.replicate.world_size(),
            )
        })
        .unwrap();
        let dry: Vec<_> = (0..world)
            .map(|rank| {
                let mesh = dry_run_mesh(rank, replicate, shard).unwrap();
                (
                    mesh.shard.rank(),
                    mesh.shard.world_size(),
                    mesh.replicate.rank(),
                    mesh.replicate.world_size(),
                )
            })
            .collect();
        assert_eq!(dry, real, "{replicate} x {shard}");
        let m = dry_run_mesh(world - 1, replicate, shard).unwrap();
        assert_eq!(
            format!("{m:?}"),
            format!(
                "HybridMesh(shard {}/{shard}, replicate {}/{replicate})",
                shard - 1,
                replicate - 1
            )
        );
    }
    assert!(matches!(
        dry_run_mesh(6, 3, 2),
        Err(CollectiveError::InvalidArgument {
            op: "dry_run_mesh",
            ..
        })
    ));
}

#[test]
fn split_names_the_way_to_build_dry_run_groups() {
    let comm = DryRunCommunicator::new(0, 4).unwrap();
    let err = comm.split(Some(1), 0).err().unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("DryRunCommunicator::new(rank, size)") && msg.contains("dry_run_mesh"),
        "{msg}"
    );
    // mesh_2d over a dry-run group of more than one rank therefore fails the same way.
    let err = mesh_2d(&comm, 2, 2).unwrap_err();
    assert!(
        matches!(err, CollectiveError::InvalidArgument { op: "split", .. }),
        "{err}"
    );
    assert!(DryRunCommunicator::new(4, 4).is_err());
    assert!(DryRunCommunicator::new(0, 0).is_err());
}
