//! [`ProcessGroup`]: the collectives of a run's processes (Accelerate's process group).
//!
//! One per process, joined on first use ([`ProcessState::group`]): the process starts
//! listening for its peers, comes to the rendezvous, connects to every peer, and from then on
//! runs collectives over those connections. Every collective has the run's timeout; the first
//! failure breaks the group, and every later call reports it.
//!
//! ## Why not burn-collective's global all-reduce
//!
//! burn-collective 0.21 does cross-process all-reduce (its "global" level), but a registration
//! can run only **one** global all-reduce: the second waits forever. Every global strategy
//! (`global/node/{centralized,tree,ring}.rs`) ends with `SyncService::sync`
//! (`burn-collective-0.21.0/src/global/node/sync.rs`), which adds the node's id to a shared
//! list of syncing peers and returns when the sorted list equals the node ids; the list is
//! then "cleared" through a copy (`self.syncing_peers.lock().unwrap().to_vec()` ...
//! `syncing_peers.clear()`), so the shared list keeps every id, and at the next sync it holds
//! duplicates and never equals the node ids again. (Burn's `multinode-tests` run one
//! all-reduce per registration, which is why they pass.) Registering again for each step
//! races in the orchestrator's node numbering (`global/orchestrator/state.rs`: a node id is
//! the count of registered nodes, reused while another node is still finishing).
//!
//! So the processes meet at a rendezvous and exchange tensors over **burn-communication**, the
//! WebSocket transport burn-collective's global level is built on; what is added here is the
//! ring schedule ([`ring`](super::ring)) and the framing. The all-reduce sums in an order fixed
//! by the ranks, so runs are reproducible bit for bit.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use bytes::Bytes;
use tokio::runtime::Runtime;

use super::error::DistributedError;
use super::mesh::Mesh;
use super::rendezvous;
use super::ring::{self, Phase};
use super::state::ProcessState;
use super::wire::{self, COLLECTIVES, Lane};

/// How an all-reduce combines the processes' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over processes.
    Sum,
    /// The mean over processes (the sum divided by their number).
    Mean,
}

/// The collectives of this process's run; a cheap handle, the same for every caller.
///
/// ```
/// use burn_accelerate::distributed::{ProcessState, ReduceOp};
///
/// let state = ProcessState::from_env()?; // one process here
/// let group = state.group()?;
/// let mut values = vec![1.0, 2.0];
/// group.all_reduce(&mut values, ReduceOp::Mean)?; // the mean over every process
/// assert_eq!(values, [1.0, 2.0]);
/// group.barrier()?;
/// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    network: Option<Network>,
    // Serialises this process's collectives and numbers them; set once one fails.
    sequence: Mutex<Result<u64, DistributedError>>,
    // The lane the next stream gets (lane 0 is the collectives').
    next_lane: std::sync::atomic::AtomicU32,
}

struct Network {
    runtime: Runtime,
    mesh: Mesh,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .finish_non_exhaustive()
    }
}

// The process's group, once joined (a failed join may be retried).
static JOINED: OnceLock<Mutex<Option<ProcessGroup>>> = OnceLock::new();

impl ProcessGroup {
    /// This process's group for `state`: joined on the first call, the same afterwards.
    pub(crate) fn join(state: &ProcessState) -> Result<Self, DistributedError> {
        let mut joined = JOINED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (rank, world) = (state.process_index(), state.num_processes());
        if let Some(group) = &*joined {
            let inner = &group.inner;
            return if (inner.rank, inner.world_size) == (rank, world) {
                Ok(group.clone())
            } else {
                Err(DistributedError::AlreadyJoined {
                    joined_rank: inner.rank,
                    joined_world: inner.world_size,
                    rank,
                    world,
                })
            };
        }
        let group = Self::connect(state)?;
        *joined = Some(group.clone());
        Ok(group)
    }

    fn connect(state: &ProcessState) -> Result<Self, DistributedError> {
        let Some(rendezvous) = state.rendezvous() else {
            return Ok(Self::new(0, 1, Duration::MAX, None));
        };
        let (rank, world) = (state.process_index(), state.num_processes());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("burn-accelerate-net")
            .enable_all()
            .build()
            .map_err(|e| DistributedError::Io {
                what: "starting the network runtime".into(),
                reason: e.to_string(),
            })?;
        let timeout = rendezvous.timeout;
        if rank == 0 && !rendezvous.hosted_by_launcher {
            rendezvous::serve(rendezvous.main_port, timeout, runtime.handle())?;
        }
        let listening = super::mesh::listen(rendezvous.data_port, world, runtime.handle())?;
        let host = match &rendezvous.node_host {
            Some(host) => host.clone(),
            None => route_to(&rendezvous.main_addr, rendezvous.main_port)?,
        };
        let address = format!("ws://{}", host_port(&host, rendezvous.data_port));
        let main = host_port(&rendezvous.main_addr, rendezvous.main_port);
        let mesh = runtime.block_on(async {
            let (run, addresses) = rendezvous::join(&main, rank, world, address, timeout).await?;
            let mesh = listening.connect(rank, run, addresses);
            // Every connection is opened now: the first step pays nothing for it, and a peer
            // that dies later closes its connection, which fails a collective at once.
            for peer in (0..world).filter(|p| *p != rank) {
                mesh.send(
                    peer,
                    wire::encode(COLLECTIVES, 0, 0, &[]),
                    "joining",
                    timeout,
                )
                .await?;
            }
            for peer in (0..world).filter(|p| *p != rank) {
                mesh.recv(peer, COLLECTIVES, "joining").await?;
            }
            Ok::<_, DistributedError>(mesh)
        })?;
        log::info!("burn-accelerate: joined the run as process {rank} of {world}");
        Ok(Self::new(
            rank,
            world,
            timeout,
            Some(Network { runtime, mesh }),
        ))
    }

    fn new(rank: usize, world_size: usize, timeout: Duration, network: Option<Network>) -> Self {
        Self {
            inner: Arc::new(Inner {
                rank,
                world_size,
                timeout,
                network,
                sequence: Mutex::new(Ok(1)),
                next_lane: std::sync::atomic::AtomicU32::new(COLLECTIVES + 1),
            }),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// Replaces `values` on every process by their sum or mean over all processes; every
    /// process ends with the same bits. Every process must call it, in the same order as its
    /// other collectives, with as many values.
    ///
    /// # Errors
    /// [`DistributedError::PeerLost`] when a process left, [`DistributedError::Timeout`] when
    /// one did not come in time, [`DistributedError::Mismatch`] for processes calling
    /// different collectives, [`DistributedError::Broken`] after any earlier failure.
    pub fn all_reduce(&self, values: &mut [f32], op: ReduceOp) -> Result<(), DistributedError> {
        let len = values.len();
        self.collective(
            |seq| format!("all-reduce #{seq} ({len} values)"),
            |network, seq| self.ring(network, seq, values),
        )?;
        if op == ReduceOp::Mean && self.inner.network.is_some() {
            let n = self.inner.world_size as f32;
            values.iter_mut().for_each(|v| *v /= n);
        }
        Ok(())
    }

    /// [`all_reduce`](Self::all_reduce) of a float tensor, through the host: the result is on
    /// the tensor's device, in its dtype.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, DistributedError> {
        if self.inner.network.is_none() {
            return Ok(tensor);
        }
        let (shape, dtype, device) = (tensor.shape(), tensor.dtype(), tensor.device());
        let mut values = to_f32(tensor.into_data());
        self.all_reduce(&mut values, op)?;
        Ok(
            Tensor::<B, D>::from_data(TensorData::new(values, shape), &device)
                .cast(burn::tensor::FloatDType::from(dtype)),
        )
    }

    /// Waits until every process calls it (Accelerate's `wait_for_everyone`).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn barrier(&self) -> Result<(), DistributedError> {
        self.all_reduce(&mut [], ReduceOp::Sum)
    }

    /// Every process's `bytes`, in rank order (a ring all-gather of messages of any sizes).
    pub(crate) fn all_gather_bytes(
        &self,
        bytes: Vec<u8>,
    ) -> Result<Vec<Vec<u8>>, DistributedError> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let mut gathered: Vec<Vec<u8>> = vec![Vec::new(); n];
        gathered[rank] = bytes;
        let slots = &mut gathered;
        self.collective(
            |seq| format!("all-gather #{seq}"),
            |network, seq| async move {
                let during = format!("all-gather #{seq}");
                // At step s, pass on the bytes of rank r - s and take those of rank r - s - 1.
                for step in 0..n - 1 {
                    let (send, receive) = ((rank + n - step) % n, (rank + 2 * n - step - 1) % n);
                    let message = wire::encode_bytes(COLLECTIVES, seq, step as u32, &slots[send]);
                    let payload = self
                        .ring_step(network, seq, step as u32, message, &during)
                        .await?;
                    slots[receive] = payload.to_vec();
                }
                Ok(())
            },
        )?;
        Ok(gathered)
    }

    /// Process `root`'s `bytes` on every process (the others' are not sent).
    pub(crate) fn broadcast_bytes(
        &self,
        root: usize,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, DistributedError> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        if root >= n {
            return Err(DistributedError::Mismatch {
                rank,
                detail: format!("broadcast from process {root}, but there are {n}"),
            });
        }
        let mut result = bytes;
        let value = &mut result;
        self.collective(
            |seq| format!("broadcast #{seq} from process {root}"),
            |network, seq| async move {
                let during = format!("broadcast #{seq}");
                if rank == root {
                    let message = wire::encode_bytes(COLLECTIVES, seq, 0, value);
                    for peer in (0..n).filter(|p| *p != root) {
                        network
                            .mesh
                            .send(peer, message.clone(), &during, self.inner.timeout)
                            .await?;
                    }
                } else {
                    let received = network.mesh.recv(root, COLLECTIVES, &during).await?;
                    *value = expect(received, root, seq, 0)?.to_vec();
                }
                Ok(())
            },
        )?;
        Ok(result)
    }

    /// A new stream of point-to-point messages, ordered apart from the collectives (whose
    /// order every process shares) and from other streams. Every process must open its streams
    /// in the same order: the n-th stream of each process talks to the n-th of the others.
    pub(crate) fn stream(&self) -> Stream {
        Stream {
            group: self.clone(),
            lane: self
                .inner
                .next_lane
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst),
        }
    }

    // Runs collective number `seq` with the run's timeout (nothing to do for one process), or
    // reports the failure that broke the group; a failure breaks it.
    fn collective<'a, F>(
        &'a self,
        what: impl FnOnce(u64) -> String,
        run: impl FnOnce(&'a Network, u64) -> F,
    ) -> Result<(), DistributedError>
    where
        F: std::future::Future<Output = Result<(), DistributedError>>,
    {
        let Some(network) = &self.inner.network else {
            return Ok(());
        };
        let mut sequence = self
            .inner
            .sequence
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = match &*sequence {
            Ok(seq) => *seq,
            Err(err) => return Err(DistributedError::Broken(err.to_string())),
        };
        let timeout = self.inner.timeout;
        let outcome = network.runtime.block_on(async {
            tokio::time::timeout(timeout, run(network, seq))
                .await
                .map_err(|_| DistributedError::Timeout {
                    what: what(seq),
                    after: timeout,
                    hint: "another process did not reach the same collective: is one stuck, \
                           or making other collective calls?",
                })?
        });
        *sequence = match &outcome {
            Ok(()) => Ok(seq + 1),
            Err(err) => Err(err.clone()),
        };
        outcome
    }

    // One step of a ring: sends `message` to the next process while taking the previous
    // one's message of step `step` of collective `seq`; returns its payload.
    async fn ring_step(
        &self,
        network: &Network,
        seq: u64,
        step: u32,
        message: Bytes,
        during: &str,
    ) -> Result<Bytes, DistributedError> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let (sent, received) = tokio::join!(
            network.mesh.send(next, message, during, self.inner.timeout),
            network.mesh.recv(prev, COLLECTIVES, during),
        );
        sent?;
        expect(received?, prev, seq, step)
    }

    async fn ring(
        &self,
        network: &Network,
        seq: u64,
        values: &mut [f32],
    ) -> Result<(), DistributedError> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let prev = (rank + n - 1) % n;
        let during = format!("all-reduce #{seq}");
        let len = values.len();
        for (p, phase) in [Phase::ReduceScatter, Phase::AllGather]
            .into_iter()
            .enumerate()
        {
            for step in 0..n - 1 {
                let (send, receive) = ring::exchange(phase, rank, n, step);
                let wire_step = (p * n + step) as u32;
                let message = wire::encode(
                    COLLECTIVES,
                    seq,
                    wire_step,
                    &values[ring::chunk(len, n, send)],
                );
                let payload = self
                    .ring_step(network, seq, wire_step, message, &during)
                    .await?;
                let target = &mut values[ring::chunk(len, n, receive)];
                let got = wire::values(&payload)
                    .filter(|got| got.len() == target.len())
                    .ok_or_else(|| DistributedError::Mismatch {
                        rank: prev,
                        detail: format!(
                            "its chunk has {} bytes where this process expects {} values \
                             (buffers of different lengths)",
                            payload.len(),
                            target.len()
                        ),
                    })?;
                match phase {
                    Phase::ReduceScatter => {
                        target.iter_mut().zip(got.iter()).for_each(|(v, g)| *v += g)
                    }
                    Phase::AllGather => target.copy_from_slice(&got),
                }
            }
        }
        Ok(())
    }
}

/// The payload of `received`, checked to be step `step` of collective `seq` from `peer`.
fn expect(received: Bytes, peer: usize, seq: u64, step: u32) -> Result<Bytes, DistributedError> {
    let mismatch = |detail: String| DistributedError::Mismatch { rank: peer, detail };
    let (header, payload) =
        wire::decode(&received).ok_or_else(|| mismatch("it sent something unreadable".into()))?;
    if (header.seq, header.step) != (seq, step) {
        return Err(mismatch(format!(
            "it is at collective #{} step {}, this process at #{seq} step {step}",
            header.seq, header.step
        )));
    }
    let start = received.len() - payload.len();
    Ok(received.slice(start..))
}

/// A tensor's values as f32, whatever its float dtype.
pub(crate) fn to_f32(data: TensorData) -> Vec<f32> {
    let data = if data.dtype == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    };
    data.into_vec::<f32>().expect("f32 data")
}

/// `host:port`, with IPv6 hosts bracketed.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The address of the interface this machine reaches `main` through (no packet is sent:
/// connecting a UDP socket only picks the route).
fn route_to(main: &str, port: u16) -> Result<String, DistributedError> {
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0))
        .and_then(|s| s.connect((main, port)).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| DistributedError::InvalidVariable {
            name: super::env::MASTER_ADDR,
            value: main.to_string(),
            expected: format!(
                "a host this machine can reach ({e}); or set {} to this machine's address",
                super::env::NODE_HOST
            ),
        })?;
    Ok(socket.ip().to_string())
}

/// Point-to-point messages between processes on a lane of their own (see
/// [`ProcessGroup::stream`]): each carries a tag (`seq`, `step`) the receiver checks, in the
/// order it was sent. Every wait has the run's timeout.
pub(crate) struct Stream {
    group: ProcessGroup,
    lane: Lane,
}

impl Stream {
    /// The group this stream belongs to.
    pub(crate) fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Sends `payload` to process `to`, tagged `(seq, step)`.
    pub(crate) fn send(
        &self,
        to: usize,
        seq: u64,
        step: u32,
        payload: &[u8],
    ) -> Result<(), DistributedError> {
        let Some(network) = &self.group.inner.network else {
            return Ok(());
        };
        let message = wire::encode_bytes(self.lane, seq, step, payload);
        let timeout = self.group.inner.timeout;
        network
            .runtime
            .block_on(async { network.mesh.send(to, message, "a stream", timeout).await })
    }

    /// The next message from process `from`, with its tag `(seq, step)`.
    pub(crate) fn recv(&self, from: usize) -> Result<(u64, u32, Bytes), DistributedError> {
        let Some(network) = &self.group.inner.network else {
            return Err(DistributedError::PeerLost {
                rank: from,
                during: "a stream of a single process".into(),
            });
        };
        let timeout = self.group.inner.timeout;
        let received = network.runtime.block_on(async {
            tokio::time::timeout(timeout, network.mesh.recv(from, self.lane, "a stream"))
                .await
                .map_err(|_| DistributedError::Timeout {
                    what: format!("process {from}'s next message on stream {}", self.lane),
                    after: timeout,
                    hint: "it stopped sending: is it stuck, or did it stop iterating?",
                })?
        })?;
        let (header, payload) = wire::decode(&received).ok_or(DistributedError::Mismatch {
            rank: from,
            detail: "it sent something unreadable on a stream".into(),
        })?;
        let start = received.len() - payload.len();
        Ok((header.seq, header.step, received.slice(start..)))
    }
}
