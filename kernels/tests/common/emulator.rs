//! Any kernel of a program run on the host: `tests/emulate/generic.cpp` compiled as C++ with the
//! program's very source (`Program::source`, what NVRTC compiles) and a registry of its kernels
//! (`Program::kernels`), through `tests/emulate/cuda_shim.h` (a block's threads as host threads,
//! `__syncthreads` and the warps' shuffles through barriers, blocks one after another; the
//! attention's `mma.sync` from `mma_emulated.h`). A test gives the buffers and the launches —
//! each kernel's grid, block and parameters as its launcher in `src/launch/` passes them — and
//! reads the buffers back, to hold the kernel to its twin.
//!
//! It needs a C++20 compiler (`CXX`, else `c++`, `g++` or `clang++`); without one
//! [`Emulator::build`] says `skipped: …` and returns `None` (CI has one). A run that does not end
//! within [`RUN_TIMEOUT`] (a barrier that not every thread reaches) is killed and fails.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, LaunchConfig};
use fsdp_kernels::launch::plan::{KernelLaunch, Param};
use fsdp_kernels::Program;

/// The longest a run may take.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// The address [`Emulator::run_plan`] gives buffer `buf` (its offsets below 2^40), for the
/// launchers' plans (`fsdp_kernels::launch::plan`).
pub fn addr(buf: usize) -> u64 {
    (buf as u64 + 1) << 40
}

/// Buffer and offset of an address made by [`addr`].
pub fn buffer_at(a: u64) -> (usize, usize) {
    assert!(
        a >= 1 << 40,
        "{a:#x} is no buffer's address (emulator::addr)"
    );
    ((a >> 40) as usize - 1, (a & ((1 << 40) - 1)) as usize)
}

/// One kernel parameter, as a launcher passes it.
#[derive(Clone, Debug)]
pub enum Arg {
    /// A pointer: buffer `.0`'s address plus `.1` bytes.
    Ptr(usize, usize),
    /// A null pointer (a launcher's 0 for "none").
    Null,
    /// A value's bytes (little-endian), its size the parameter's.
    Value(Vec<u8>),
    /// A struct passed by value (its bytes as the launcher lays it out), with the 8-byte
    /// fields at `at` holding buffer `buf`'s address plus `offset` bytes: `(at, buf, offset)`.
    Struct(Vec<u8>, Vec<(usize, usize, usize)>),
}

impl Arg {
    /// Buffer `buf`'s address.
    pub fn buf(buf: usize) -> Arg {
        Arg::Ptr(buf, 0)
    }
    pub fn u64(v: u64) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
    pub fn u32(v: u32) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
    pub fn i32(v: i32) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
    pub fn u16(v: u16) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
    pub fn f32(v: f32) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
    pub fn f64(v: f64) -> Arg {
        Arg::Value(v.to_le_bytes().to_vec())
    }
}

/// One launch: `kernel` on a grid of `grid.0 × grid.1` blocks of `threads × block_y` threads
/// (`threadIdx.x` below `threads`, `threadIdx.y` below `block_y`).
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: String,
    pub grid: (u32, u32),
    pub threads: u32,
    pub block_y: u32,
    pub args: Vec<Arg>,
}

impl Launch {
    /// On one-dimensional blocks of `threads`.
    pub fn new(kernel: &str, grid: (u32, u32), threads: u32, args: Vec<Arg>) -> Launch {
        Launch::new_2d(kernel, grid, (threads, 1), args)
    }

    /// On blocks of `block.0 × block.1` threads.
    pub fn new_2d(kernel: &str, grid: (u32, u32), block: (u32, u32), args: Vec<Arg>) -> Launch {
        Launch {
            kernel: kernel.to_string(),
            grid,
            threads: block.0,
            block_y: block.1,
            args,
        }
    }

    /// A launch on a launcher's own grid (`fsdp_kernels::launch::config`, `per_row`, …).
    pub fn from_config(kernel: &str, cfg: &LaunchConfig, args: Vec<Arg>) -> Launch {
        assert_eq!(
            (cfg.grid_dim.2, cfg.block_dim.2, cfg.shared_mem_bytes),
            (1, 1, 0),
            "{kernel}: a grid or block in z, or dynamic shared memory"
        );
        Launch::new_2d(
            kernel,
            (cfg.grid_dim.0, cfg.grid_dim.1),
            (cfg.block_dim.0, cfg.block_dim.1),
            args,
        )
    }

    /// A launcher's planned launch (`fsdp_kernels::launch::plan`) on buffers addressed by
    /// [`addr`]: pointers become buffers and offsets (0 a null pointer), structs their bytes
    /// with their pointer fields relocated (zero ones left null).
    pub fn from_plan(l: &KernelLaunch) -> Launch {
        let args = l
            .params
            .iter()
            .map(|p| match p {
                Param::Ptr(0) => Arg::Null,
                Param::Ptr(a) => {
                    let (b, o) = buffer_at(*a);
                    Arg::Ptr(b, o)
                }
                Param::U64(v) => Arg::u64(*v),
                Param::U32(v) => Arg::u32(*v),
                Param::U16(v) => Arg::u16(*v),
                Param::I32(v) => Arg::i32(*v),
                Param::F32(v) => Arg::f32(*v),
                Param::F64(v) => Arg::f64(*v),
                Param::Struct(s) => {
                    let bytes = s.bytes();
                    let relocs = s
                        .pointer_offsets()
                        .iter()
                        .filter_map(|&at| {
                            let a = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
                            (a != 0).then(|| {
                                let (b, o) = buffer_at(a);
                                (at, b, o)
                            })
                        })
                        .collect();
                    Arg::Struct(bytes, relocs)
                }
                other => panic!(
                    "{}: a parameter the emulator does not know: {other:?}",
                    l.kernel
                ),
            })
            .collect();
        Launch::from_config(&l.kernel, &l.config, args)
    }

    /// A launch on the element-wise launchers' grid for `n` elements (`launch::config`).
    pub fn elementwise(kernel: &str, n: usize, args: Vec<Arg>) -> Launch {
        Launch::from_config(kernel, &fsdp_kernels::launch::config(n), args)
    }
}

/// A program's kernels built for the host (or, under `FSDP_EMULATED_ON=cuda`, a GPU that runs
/// the plans instead: `common::on_device`).
pub struct Emulator {
    program: Program,
    exe: PathBuf,
    dir: PathBuf,
    runs: Mutex<u64>,
    cuda: Option<Arc<CudaStream>>,
}

fn compiler() -> Option<String> {
    std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from))
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

impl Emulator {
    /// `program`'s kernels built once per test process (and reused across processes while the
    /// sources are unchanged), or `None`, printing `<test>: skipped: …`, without a C++
    /// compiler.
    pub fn build(program: Program, test: &str) -> Option<&'static Emulator> {
        static BUILT: OnceLock<Mutex<Vec<(Program, &'static Emulator)>>> = OnceLock::new();
        match std::env::var("FSDP_EMULATED_ON").as_deref() {
            Ok("cuda") => {
                let Some(cuda) = super::gpu_stream(test) else {
                    panic!("{test}: FSDP_EMULATED_ON=cuda, but no GPU");
                };
                println!("{test}: on the GPU (FSDP_EMULATED_ON=cuda), not the host emulator");
                return Some(Box::leak(Box::new(Emulator {
                    program,
                    exe: PathBuf::new(),
                    dir: PathBuf::new(),
                    runs: Mutex::new(0),
                    cuda: Some(cuda),
                })));
            }
            Ok("") | Ok("host") | Err(_) => {}
            Ok(other) => panic!("FSDP_EMULATED_ON={other}: host or cuda"),
        }
        let Some(cxx) = compiler() else {
            println!("{test}: skipped: no C++ compiler (CXX, c++, g++ or clang++)");
            return None;
        };
        let built = BUILT.get_or_init(|| Mutex::new(Vec::new()));
        let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, e)) = built.iter().find(|(p, _)| *p == program) {
            return Some(e);
        }
        let e: &'static Emulator = Box::leak(Box::new(build(&cxx, program)));
        built.push((program, e));
        Some(e)
    }

    /// Whether the plans run on a GPU (`FSDP_EMULATED_ON=cuda`) rather than the emulator.
    pub fn on_cuda(&self) -> bool {
        self.cuda.is_some()
    }

    /// Run a launcher's planned `launches` (`fsdp_kernels::launch::plan`, on addresses from
    /// [`addr`]) in order over `buffers`; every launch must be of this emulator's program.
    pub fn run_plan(&self, buffers: &mut [Vec<u8>], launches: &[KernelLaunch]) {
        for l in launches {
            assert_eq!(
                l.program, self.program,
                "{} is not of {:?}",
                l.kernel, self.program
            );
        }
        if let Some(cuda) = &self.cuda {
            return super::on_device::run(cuda, buffers, launches);
        }
        let launches: Vec<Launch> = launches.iter().map(Launch::from_plan).collect();
        self.run(buffers, &launches);
    }

    /// Run a plan that must be refused (`why` says why it must), and return the refusal's
    /// message: the emulator's (or, on a GPU, the driver's) words.
    pub fn run_plan_refused(
        &self,
        buffers: &mut [Vec<u8>],
        launches: &[KernelLaunch],
        why: &str,
    ) -> String {
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run_plan(buffers, launches)
        }))
        .expect_err(why);
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    /// Run `launches` in order over `buffers` (each kernel's outputs written in place), on the
    /// host emulator.
    pub fn run(&self, buffers: &mut [Vec<u8>], launches: &[Launch]) {
        assert!(
            self.cuda.is_none(),
            "hand-built launches run on the host emulator only"
        );
        let n = {
            let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            *runs += 1;
            *runs
        };
        let dir = self.dir.join(format!("run-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut req = format!("buffers {}\n", buffers.len());
        for b in buffers.iter() {
            req += &format!("{}\n", b.len());
        }
        for l in launches {
            req += &format!(
                "launch {} {} {} {} {} {}\n",
                l.kernel,
                l.grid.0,
                l.grid.1,
                l.threads,
                l.block_y,
                l.args.len()
            );
            for a in &l.args {
                req += &match a {
                    Arg::Ptr(b, o) => format!("p {b} {o}\n"),
                    Arg::Null => "n\n".to_string(),
                    Arg::Value(v) => format!("v {} 0\n", hex(v)),
                    Arg::Struct(v, relocs) => {
                        let r: String = relocs
                            .iter()
                            .map(|(at, b, o)| format!(" {at} {b} {o}"))
                            .collect();
                        format!("v {} {}{r}\n", hex(v), relocs.len())
                    }
                };
            }
        }
        std::fs::write(dir.join("request.txt"), req).unwrap();
        std::fs::write(dir.join("in.bin"), buffers.concat()).unwrap();
        let mut cmd = Command::new(&self.exe);
        cmd.arg(&dir);
        let names: Vec<&str> = launches.iter().map(|l| l.kernel.as_str()).collect();
        let run = output_within(cmd, RUN_TIMEOUT, &format!("{names:?}"));
        assert!(
            run.status.success(),
            "the emulator failed ({}) on {launches:?}: {}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        );
        let out = std::fs::read(dir.join("out.bin")).unwrap();
        let mut at = 0;
        for b in buffers.iter_mut() {
            let n = b.len();
            b.copy_from_slice(&out[at..at + n]);
            at += n;
        }
        assert_eq!(at, out.len(), "out.bin's length");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `cmd`'s output, killed (and the test failed) past `timeout`: an emulated barrier that not
/// every thread reaches never returns. Its output is read while it runs, so no pipe fills up.
pub fn output_within(mut cmd: Command, timeout: Duration, what: &str) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    fn drain(mut p: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = p.read_to_end(&mut v);
            v
        })
    }
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the emulator ran past {timeout:?} on {what}: a barrier not every thread reached?"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn hex(v: &[u8]) -> String {
    if v.is_empty() {
        return "00".into();
    }
    v.iter().map(|b| format!("{b:02x}")).collect()
}

/// The compiler's flags: IEEE arithmetic as NVRTC's `--fmad=false` (nothing fused but
/// `__fmaf_rn`), no type-based alias analysis (the kernels read 16-bit storage through wider
/// types, as CUDA allows), and every warning an error.
const FLAGS: [&str; 9] = [
    "-std=c++20",
    "-O1",
    "-pthread",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
    "-Werror",
];

/// The sanitizer `FSDP_EMU_SANITIZE` names (`thread`, `address` or `undefined`), if any: the
/// emulators are built with it, in a directory of their own. ThreadSanitizer reports a
/// kernel's threads racing on shared or global memory (a missing `__syncthreads`), as the
/// GPU's `compute-sanitizer --tool racecheck` would; the others out-of-bounds accesses and
/// undefined behaviour. Slow (minutes): not part of CI's test run;
/// `scripts/emulate-sanitized.sh` runs every emulated test so.
fn sanitizer() -> Option<String> {
    std::env::var("FSDP_EMU_SANITIZE")
        .ok()
        .filter(|s| !s.is_empty())
}

/// What `program` needs emulated besides `cuda_shim.h`, included before its source
/// (`generic.cpp`'s `EMU_PRELUDE`): [`Program::Attention`]'s `mma.sync` (`mma_emulated.h`,
/// the PTX ISA's fragment layouts, which its kernels leave to the emulator where
/// `FA_MMA_EMULATED` is defined).
fn prelude(program: Program) -> Option<&'static str> {
    match program {
        Program::Attention => Some("mma_emulated.h"),
        _ => None,
    }
}

/// Each `__launch_bounds__(B) name(` of `source`: the kernel and its bound's expression (the
/// program's macros evaluate it where the emulator is compiled, which refuses larger blocks).
fn launch_bounds(source: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("__launch_bounds__(") {
        rest = &rest[at + "__launch_bounds__(".len()..];
        let mut depth = 1;
        let Some(end) = rest.char_indices().find_map(|(i, c)| {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            (depth == 0).then_some(i)
        }) else {
            break;
        };
        let bound = rest[..end].to_string();
        let after = rest[end + 1..].trim_start();
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && after[name.len()..].trim_start().starts_with('(') {
            out.push((name, bound));
        }
        rest = &rest[end..];
    }
    out
}

/// Compile the emulator of `program` with `cxx` into the tests' scratch directory, unless the
/// same inputs were compiled there before.
fn build(cxx: &str, program: Program) -> Emulator {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let shim = manifest.join("tests/emulate");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("emulate")
        .join(format!(
            "{}{}",
            program.name().trim_end_matches(".cu"),
            sanitizer().map(|k| format!("-{k}")).unwrap_or_default()
        ));
    std::fs::create_dir_all(&dir).unwrap();
    let source = program.source();
    let mut registry: String = program
        .kernels()
        .iter()
        .map(|k| format!("EMU_KERNEL({k})\n"))
        .collect();
    for (kernel, bound) in launch_bounds(&source) {
        if program.kernels().contains(&kernel) {
            registry += &format!("EMU_BOUNDS({kernel}, {bound})\n");
        }
    }
    let read = |f: &str| std::fs::read_to_string(shim.join(f)).unwrap();
    // The program's prelude and the sanitizer, beside the common FLAGS.
    let mut extra_flags: Vec<String> = prelude(program)
        .map(|h| format!("-DEMU_PRELUDE=\"{h}\""))
        .into_iter()
        .collect();
    if let Some(kind) = sanitizer() {
        extra_flags.extend([
            format!("-fsanitize={kind}"),
            "-fno-sanitize-recover=all".into(),
            "-g".into(),
        ]);
    }
    let mut key = format!(
        "{cxx} {}\n{}\n{}\n{source}\n{registry}",
        FLAGS.join(" "),
        read("cuda_shim.h"),
        read("generic.cpp")
    );
    key += &format!("{}\n", extra_flags.join(" "));
    if let Some(h) = prelude(program) {
        key += &format!("{}\n", read(h));
    }
    let exe = dir.join("emu");
    let key_path = dir.join("key.txt");
    if exe.exists() && std::fs::read_to_string(&key_path).ok().as_deref() == Some(key.as_str()) {
        return Emulator {
            program,
            exe,
            dir,
            runs: Mutex::new(0),
            cuda: None,
        };
    }
    // Built apart and moved into place, so that test processes building the same program at
    // once never read each other's half-written files.
    let tmp = dir.join(format!(
        "build-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("program.cu"), &source).unwrap();
    std::fs::write(tmp.join("registry.inc"), &registry).unwrap();
    let built = tmp.join("emu");
    let out = Command::new(cxx)
        .args(FLAGS)
        .args(&extra_flags)
        .arg("-I")
        .arg(&tmp)
        .arg("-I")
        .arg(&shim)
        .arg("-o")
        .arg(&built)
        .arg(shim.join("generic.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        out.status.success(),
        "{cxx} could not build the emulator of {}:\n{}",
        program.name(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&built, &exe).unwrap();
    std::fs::write(tmp.join("key.txt"), &key).unwrap();
    std::fs::rename(tmp.join("key.txt"), &key_path).unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    Emulator {
        program,
        exe,
        dir,
        runs: Mutex::new(0),
        cuda: None,
    }
}

/// Little-endian bytes of plain values, and back.
pub trait Plain: Copy {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl Plain for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
        }
    )*};
}
plain!(f32, f64, u16, u32, u64, i32);

/// `v`'s bytes (little-endian).
pub fn bytes_of<T: Plain>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::SIZE);
    for &x in v {
        x.put(&mut out);
    }
    out
}

/// The values of `b` (little-endian `T`s).
pub fn values_of<T: Plain>(b: &[u8]) -> Vec<T> {
    assert_eq!(
        b.len() % T::SIZE,
        0,
        "{} bytes of {}-byte values",
        b.len(),
        T::SIZE
    );
    b.chunks_exact(T::SIZE).map(T::get).collect()
}
