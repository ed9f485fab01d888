//! Elastic machine counts (`burn-accelerate launch --num-machines MIN:MAX`, torchrun's
//! `--nnodes MIN:MAX`): which machines take part in each attempt of a run.
//!
//! The main machine's launcher (`--machine-rank 0`, which hosts the rendezvous) coordinates.
//! Every other machine's launcher holds a control connection to it, on the rendezvous's own
//! port, authenticated with the run's secret as every connection of the run is; both ends send
//! a heartbeat every second and count the other as lost after the liveness timeout of silence
//! (or at once, when the connection closes: a launcher that died).
//!
//! At each attempt the coordinator decides the members ([`decide`]): itself and the launchers
//! that are connected and ready (not still stopping an earlier attempt's processes), as soon as
//! `MAX` machines are ready, or once the join window has passed with at least `MIN`. It numbers
//! them (itself 0, the others in the order of their `--machine-rank`), and tells each its
//! machine rank and the run's size. A launcher that arrives while an attempt runs waits for the
//! next one. When a member fails or is lost, the coordinator stops the attempt everywhere and,
//! while `--max-restarts` allows, starts the next one with the machines that are left.
//!
//! The coordinator is the one machine the run cannot lose: without it there is no rendezvous
//! (as torchrun's c10d store host). A launcher that loses it stops its processes and tries to
//! reach it again until the run's timeout, then gives up.

use std::collections::BTreeMap;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::engine::tcp::rendezvous::{self, ControlStream};

type ToMember = rendezvous::ToMember<AttemptPlan>;
type ToCoordinator = rendezvous::ToCoordinator<Shape>;
use crate::{DistributedError, RendezvousHost, RunSecret};

/// How often each end of a control connection says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// How long a connecting launcher may take to say who it is.
const HELLO_WITHIN: Duration = Duration::from_secs(10);

/// The machines an elastic run may have, and the processes each runs: what every launcher of
/// the run must agree on (the coordinator refuses one that says otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// The fewest machines an attempt may start with.
    pub min: u32,
    /// The most.
    pub max: u32,
    /// Processes on each machine.
    pub local: u32,
}

/// The machines of an attempt, by the `--machine-rank` their launchers were started with;
/// their place in the list is their machine rank in the attempt (the coordinator, 0, first).
///
/// `ready` are the other launchers that are connected and ready to start. `None` while the
/// coordinator should wait for more: fewer than `max` are ready and the join window is still
/// open, or fewer than `min` are.
///
/// ```
/// use burn_accelerate_comm::membership::decide;
///
/// assert_eq!(decide(&[3, 1], 1, 3, false), Some(vec![0, 1, 3])); // all there: no waiting
/// assert_eq!(decide(&[1], 1, 3, false), None); // the window is open: wait for more
/// assert_eq!(decide(&[1], 1, 3, true), Some(vec![0, 1])); // it closed with at least MIN
/// assert_eq!(decide(&[], 2, 3, true), None); // fewer than MIN: keep waiting
/// assert_eq!(decide(&[2, 1, 3], 1, 3, false), Some(vec![0, 1, 2])); // 3 waits its turn
/// ```
pub fn decide(ready: &[u32], min: u32, max: u32, window_over: bool) -> Option<Vec<u32>> {
    let mut members: Vec<u32> = ready.iter().copied().filter(|&m| m != 0).collect();
    members.sort_unstable();
    members.dedup();
    members.insert(0, 0);
    members.truncate(max as usize);
    let count = members.len() as u32;
    (count == max || (window_over && count >= min)).then_some(members)
}

/// What the coordinator tells a member launcher to do at the start of an attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptPlan {
    /// The attempt (the processes' restart count).
    pub attempt: u64,
    /// This machine's rank in the attempt: its processes are ranks `machine_rank * local ..`.
    pub machine_rank: u32,
    /// The attempt's machines, by their launchers' `--machine-rank`.
    pub machines: Vec<u32>,
}

/// The plan of each member of an attempt whose machines are `machines` ([`decide`]'s answer),
/// but the coordinator's own (machine rank 0).
pub fn plans(attempt: u64, machines: &[u32]) -> Vec<(u32, AttemptPlan)> {
    machines
        .iter()
        .enumerate()
        .skip(1)
        .map(|(rank, &machine)| {
            (
                machine,
                AttemptPlan {
                    attempt,
                    machine_rank: rank as u32,
                    machines: machines.to_vec(),
                },
            )
        })
        .collect()
}

// What a connection's tasks tell the coordinator; `conn` tells a replaced connection's last
// words from its successor's.
enum Event {
    Joined {
        machine: u32,
        conn: u64,
        shape: Shape,
        send: mpsc::UnboundedSender<ToMember>,
        writer: JoinHandle<()>,
    },
    Said {
        conn: u64,
        message: ToCoordinator,
    },
    Lost {
        conn: u64,
        why: String,
    },
}

struct Member {
    conn: u64,
    send: mpsc::UnboundedSender<ToMember>,
    writer: JoinHandle<()>,
    heard: Instant,
    /// Ready to start an attempt (it has no processes running).
    ready: bool,
    /// The attempt its processes run, told and not yet ended.
    running: Option<u64>,
}

/// What an attempt's members did, as far as the coordinator knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptState {
    /// Some member's processes still run.
    Running,
    /// Every member's processes succeeded.
    Succeeded,
    /// A member failed or was lost: what happened, in words.
    Failed(String),
}

/// The coordinating launcher's side: who is connected, and what each attempt's members did.
pub struct Coordinator {
    runtime: Handle,
    shape: Shape,
    liveness: Duration,
    events: std_mpsc::Receiver<Event>,
    members: BTreeMap<u32, Member>,
    /// Per attempt: the members told to run it, and the first failure heard.
    attempt: Option<(u64, Vec<u32>, Option<String>)>,
}

impl Coordinator {
    /// Takes the control connections that come to `host` (the run's rendezvous) from now on.
    /// A connection silent for `liveness` counts as lost.
    pub fn start(
        host: &RendezvousHost,
        shape: Shape,
        liveness: Duration,
        runtime: &Handle,
    ) -> Self {
        let mut incoming = host.0.control_connections();
        let (events, receiver) = std_mpsc::channel();
        runtime.spawn(async move {
            let mut conn = 0;
            while let Some(stream) = incoming.recv().await {
                conn += 1;
                tokio::spawn(serve_member(stream, conn, liveness, events.clone()));
            }
        });
        Self {
            runtime: runtime.clone(),
            shape,
            liveness,
            events: receiver,
            members: BTreeMap::new(),
            attempt: None,
        }
    }

    // Takes in what the connections said.
    fn pump(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            match event {
                Event::Joined {
                    machine,
                    conn,
                    shape,
                    send,
                    writer,
                } => self.join(machine, conn, shape, send, writer),
                Event::Said { conn, message } => {
                    let Some((&machine, member)) =
                        self.members.iter_mut().find(|(_, m)| m.conn == conn)
                    else {
                        continue;
                    };
                    member.heard = Instant::now();
                    if let ToCoordinator::Ended { attempt, ok, what } = message {
                        member.ready = true;
                        member.running = None;
                        self.ended(machine, attempt, ok, &what);
                    }
                }
                Event::Lost { conn, why } => {
                    let Some(machine) = self
                        .members
                        .iter()
                        .find(|(_, m)| m.conn == conn)
                        .map(|(&machine, _)| machine)
                    else {
                        continue;
                    };
                    let member = self.members.remove(&machine).expect("found above");
                    eprintln!("burn-accelerate launch: lost machine {machine}'s launcher: {why}");
                    if let Some(attempt) = member.running {
                        self.ended(
                            machine,
                            attempt,
                            false,
                            &format!("its launcher was lost ({why})"),
                        );
                    }
                }
            }
        }
    }

    fn join(
        &mut self,
        machine: u32,
        conn: u64,
        shape: Shape,
        send: mpsc::UnboundedSender<ToMember>,
        writer: JoinHandle<()>,
    ) {
        let refuse = |why: String| {
            eprintln!("burn-accelerate launch: refused machine {machine}'s launcher: {why}");
            let _ = send.send(ToMember::Refused(why));
        };
        if shape != self.shape {
            return refuse(format!(
                "it runs {} processes of a run of {}:{} machines, this one {} processes of \
                 {}:{}: give every launcher the same --num-processes and --num-machines",
                shape.local, shape.min, shape.max, self.shape.local, self.shape.min, self.shape.max
            ));
        }
        if machine == 0 || machine >= self.shape.max {
            return refuse(format!(
                "--machine-rank {machine} is not in 1..{}: this machine is 0, and the run has \
                 at most {} machines",
                self.shape.max, self.shape.max
            ));
        }
        if let Some(earlier) = self.members.get(&machine) {
            // A launcher that lost its connection comes back before this side noticed (it
            // noticed after the liveness timeout of silence, which this side saw too): the
            // newer connection is the one alive. Two live launchers with one rank are not.
            if earlier.heard.elapsed() < (HEARTBEAT * 2).min(self.liveness / 2) {
                return refuse(format!(
                    "another launcher is machine {machine} already: give each machine its own \
                     --machine-rank"
                ));
            }
            let earlier = self.members.remove(&machine).expect("found above");
            earlier.writer.abort();
            if let Some(attempt) = earlier.running {
                self.ended(
                    machine,
                    attempt,
                    false,
                    "its launcher connected again, its processes gone",
                );
            }
        }
        eprintln!("burn-accelerate launch: machine {machine}'s launcher joined the run");
        self.members.insert(
            machine,
            Member {
                conn,
                send,
                writer,
                heard: Instant::now(),
                ready: true,
                running: None,
            },
        );
    }

    fn ended(&mut self, machine: u32, attempt: u64, ok: bool, what: &str) {
        if let Some((current, _, failure)) = &mut self.attempt
            && *current == attempt
            && !ok
            && failure.is_none()
        {
            *failure = Some(format!("machine {machine}: {what}"));
        }
    }

    /// The machines of the next attempt ([`decide`]), waiting for them: `MAX` at once, or
    /// `MIN` once `window` has passed. `stop` is asked while waiting (a signal to the
    /// launcher): `None` when it said to stop.
    ///
    /// # Errors
    /// [`DistributedError::Timeout`] when fewer than `MIN` machines are ready within
    /// `timeout`.
    pub fn gather(
        &mut self,
        window: Duration,
        timeout: Duration,
        stop: impl Fn() -> bool,
    ) -> Result<Option<Vec<u32>>, DistributedError> {
        let start = Instant::now();
        loop {
            self.pump();
            let ready: Vec<u32> = self
                .members
                .iter()
                .filter(|(_, m)| m.ready)
                .map(|(&machine, _)| machine)
                .collect();
            let elapsed = start.elapsed();
            if let Some(machines) =
                decide(&ready, self.shape.min, self.shape.max, elapsed >= window)
            {
                return Ok(Some(machines));
            }
            if stop() {
                return Ok(None);
            }
            if elapsed >= timeout {
                return Err(DistributedError::Timeout {
                    what: format!(
                        "at least {} machines (--num-machines {}:{}) to be ready; {} are",
                        self.shape.min,
                        self.shape.min,
                        self.shape.max,
                        ready.len() + 1
                    ),
                    after: timeout,
                    hint: "start the other machines' launchers with --main-process-ip naming \
                           this machine, or lower MIN",
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Tells attempt `attempt`'s members (`machines`, [`gather`](Self::gather)'s answer) to
    /// start their processes.
    pub fn begin(&mut self, attempt: u64, machines: &[u32]) {
        self.attempt = Some((attempt, machines.to_vec(), None));
        for (machine, plan) in plans(attempt, machines) {
            if let Some(member) = self.members.get_mut(&machine) {
                member.ready = false;
                member.running = Some(attempt);
                let _ = member.send.send(ToMember::Attempt(plan));
            } else {
                self.ended(
                    machine,
                    attempt,
                    false,
                    "its launcher was lost before it started",
                );
            }
        }
    }

    /// What attempt `attempt`'s members did so far.
    pub fn state(&mut self, attempt: u64) -> AttemptState {
        self.pump();
        let Some((current, machines, failure)) = &self.attempt else {
            return AttemptState::Running;
        };
        if *current != attempt {
            return AttemptState::Running;
        }
        if let Some(failure) = failure {
            return AttemptState::Failed(failure.clone());
        }
        let running = machines[1..].iter().any(|machine| {
            self.members
                .get(machine)
                .is_some_and(|m| m.running == Some(attempt))
        });
        if running {
            AttemptState::Running
        } else {
            AttemptState::Succeeded
        }
    }

    /// Tells attempt `attempt`'s members that are still running it to stop their processes.
    pub fn stop(&mut self, attempt: u64) {
        self.pump();
        for member in self.members.values() {
            if member.running == Some(attempt) {
                let _ = member.send.send(ToMember::Stop { attempt });
            }
        }
    }

    /// Tells every connected launcher that the run is over (`ok`: it succeeded), and gives the
    /// messages a moment to leave.
    pub fn finish(mut self, ok: bool, why: &str) {
        self.pump();
        let writers: Vec<JoinHandle<()>> = std::mem::take(&mut self.members)
            .into_values()
            .map(|member| {
                let _ = member.send.send(ToMember::Finished {
                    ok,
                    why: why.to_string(),
                });
                member.writer
            })
            .collect();
        let _ = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), join_all(writers)).await
        });
    }
}

async fn join_all(handles: Vec<JoinHandle<()>>) {
    for handle in handles {
        let _ = handle.await;
    }
}

// Writes what `outgoing` brings, and `alive` every HEARTBEAT in between, until the channel
// closes or a message `last` says ends the conversation has gone: both ends of a control
// connection. The error is why writing failed.
async fn send_with_heartbeats<M: Serialize>(
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
    outgoing: &mut mpsc::UnboundedReceiver<M>,
    alive: M,
    last: impl Fn(&M) -> bool,
) -> Result<(), String> {
    let mut beat = tokio::time::interval(HEARTBEAT);
    loop {
        let beat_or_message = tokio::select! {
            message = outgoing.recv() => match message {
                Some(message) => Some(message),
                None => return Ok(()),
            },
            _ = beat.tick() => None,
        };
        let message = beat_or_message.as_ref().unwrap_or(&alive);
        if let Err(e) = rendezvous::control_send(writer, message).await {
            return Err(format!("writing to it failed ({e})"));
        }
        if last(message) {
            return Ok(());
        }
    }
}

// One member launcher's connection, on the coordinator's side: its hello, then what it says,
// until it goes silent or the connection ends.
async fn serve_member(
    (machine, mut reader, mut writer): ControlStream,
    conn: u64,
    liveness: Duration,
    events: std_mpsc::Sender<Event>,
) {
    let hello = tokio::time::timeout(
        HELLO_WITHIN,
        rendezvous::control_read::<_, ToCoordinator>(&mut reader),
    )
    .await;
    let Ok(Ok(ToCoordinator::Hello(shape))) = hello else {
        log::warn!("burn-accelerate: machine {machine}'s launcher never said hello");
        return;
    };
    let (send, mut outgoing) = mpsc::unbounded_channel::<ToMember>();
    let lost = events.clone();
    let writer = tokio::spawn(async move {
        let last = |m: &ToMember| matches!(m, ToMember::Finished { .. } | ToMember::Refused(_));
        if let Err(why) =
            send_with_heartbeats(&mut writer, &mut outgoing, ToMember::Alive, last).await
        {
            let _ = lost.send(Event::Lost { conn, why });
        }
    });
    if events
        .send(Event::Joined {
            machine,
            conn,
            shape,
            send,
            writer,
        })
        .is_err()
    {
        return;
    }
    loop {
        let read = tokio::time::timeout(liveness, rendezvous::control_read(&mut reader)).await;
        let event = match read {
            Ok(Ok(message)) => Event::Said { conn, message },
            Ok(Err(why)) => Event::Lost { conn, why },
            Err(_) => Event::Lost {
                conn,
                why: format!("it has said nothing for {liveness:?}"),
            },
        };
        let over = matches!(event, Event::Lost { .. });
        if events.send(event).is_err() || over {
            return;
        }
    }
}

/// What the coordinator told a member launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// Start this machine's processes for an attempt.
    Start(AttemptPlan),
    /// Stop the processes of this attempt.
    Stop(u64),
    /// The run is over (`ok`: it succeeded).
    Finished {
        /// Whether the run succeeded.
        ok: bool,
        /// Why it ended, in words.
        why: String,
    },
    /// The coordinator will not have this launcher: why.
    Refused(String),
    /// The coordinator is lost: silent for the liveness timeout, or its connection ended.
    Lost(String),
}

/// A member launcher's control connection to the coordinator.
pub struct MemberLink {
    orders: std_mpsc::Receiver<Order>,
    send: mpsc::UnboundedSender<ToCoordinator>,
    tasks: Vec<JoinHandle<()>>,
}

impl MemberLink {
    /// Connects to the coordinator at `main` (`host:port`, the run's rendezvous) as machine
    /// `machine`, asking again until `timeout`; the coordinator counts as lost once silent
    /// for `liveness`. `stop` is asked while waiting: `None` when it said to stop.
    ///
    /// # Errors
    /// [`DistributedError::Timeout`] when no coordinator answers within `timeout`.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        main: &str,
        machine: u32,
        shape: Shape,
        secret: &RunSecret,
        liveness: Duration,
        timeout: Duration,
        runtime: &Handle,
        stop: impl Fn() -> bool,
    ) -> Result<Option<Self>, DistributedError> {
        let start = Instant::now();
        let (mut reader, mut writer) = loop {
            let tried = runtime.block_on(rendezvous::control_connect(
                main,
                machine,
                secret,
                Duration::from_secs(5),
            ));
            match tried {
                Ok(halves) => break halves,
                Err(why) if start.elapsed() >= timeout => {
                    return Err(DistributedError::Timeout {
                        what: format!("the main machine's launcher at {main} ({why})"),
                        after: timeout,
                        hint: "is machine 0's launcher running with the same \
                               --main-process-port and secret, and is its address reachable \
                               from here?",
                    });
                }
                Err(_) if stop() => return Ok(None),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        let (orders_in, orders) = std_mpsc::channel();
        let (send, mut outgoing) = mpsc::unbounded_channel::<ToCoordinator>();
        let _ = send.send(ToCoordinator::Hello(shape));
        let lost = orders_in.clone();
        let writing = runtime.spawn(async move {
            let alive = ToCoordinator::Alive;
            if let Err(why) =
                send_with_heartbeats(&mut writer, &mut outgoing, alive, |_| false).await
            {
                let _ = lost.send(Order::Lost(why));
            }
        });
        let reading = runtime.spawn(async move {
            loop {
                let read =
                    tokio::time::timeout(liveness, rendezvous::control_read(&mut reader)).await;
                let order = match read {
                    Ok(Ok(ToMember::Alive)) => continue,
                    Ok(Ok(ToMember::Attempt(plan))) => Order::Start(plan),
                    Ok(Ok(ToMember::Stop { attempt })) => Order::Stop(attempt),
                    Ok(Ok(ToMember::Finished { ok, why })) => Order::Finished { ok, why },
                    Ok(Ok(ToMember::Refused(why))) => Order::Refused(why),
                    Ok(Err(why)) => Order::Lost(why),
                    Err(_) => Order::Lost(format!("it has said nothing for {liveness:?}")),
                };
                let over = !matches!(order, Order::Start(_) | Order::Stop(_));
                if orders_in.send(order).is_err() || over {
                    return;
                }
            }
        });
        Ok(Some(Self {
            orders,
            send,
            tasks: vec![writing, reading],
        }))
    }

    /// The coordinator's next order, if one came.
    pub fn try_next(&mut self) -> Option<Order> {
        self.orders.try_recv().ok()
    }

    /// Tells the coordinator that this machine's processes of `attempt` ended (`ok`: all
    /// succeeded; `what`: what happened, in words): it is ready for the next attempt.
    pub fn ended(&self, attempt: u64, ok: bool, what: &str) {
        let _ = self.send.send(ToCoordinator::Ended {
            attempt,
            ok,
            what: what.to_string(),
        });
    }
}

impl Drop for MemberLink {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_members_are_the_ready_machines_up_to_max_and_wait_for_min() {
        // All of MAX ready: no need to wait for the window.
        assert_eq!(decide(&[1], 1, 2, false), Some(vec![0, 1]));
        // One lost: the window must pass first (it may come back), then MIN is enough.
        assert_eq!(decide(&[], 1, 2, false), None);
        assert_eq!(decide(&[], 1, 2, true), Some(vec![0]));
        // Below MIN, even after the window.
        assert_eq!(decide(&[2], 3, 4, true), None);
        assert_eq!(decide(&[2, 3], 3, 4, true), Some(vec![0, 2, 3]));
        // More than MAX ready (a machine that came back while another stood in): the lowest
        // ranks take part, the others wait for the next attempt.
        assert_eq!(decide(&[3, 2, 1], 1, 3, false), Some(vec![0, 1, 2]));
        // The coordinator is always a member, whatever the others say.
        assert_eq!(decide(&[0, 1, 1], 1, 2, false), Some(vec![0, 1]));
    }

    #[test]
    fn each_member_gets_its_place_in_the_attempt() {
        let plans = plans(4, &[0, 2, 5]);
        assert_eq!(
            plans,
            [
                (
                    2,
                    AttemptPlan {
                        attempt: 4,
                        machine_rank: 1,
                        machines: vec![0, 2, 5]
                    }
                ),
                (
                    5,
                    AttemptPlan {
                        attempt: 4,
                        machine_rank: 2,
                        machines: vec![0, 2, 5]
                    }
                ),
            ]
        );
        assert!(super::plans(0, &[0]).is_empty());
    }

    #[test]
    fn a_member_joins_is_told_to_start_and_its_loss_fails_the_attempt() {
        let runtime = crate::loopback::runtime();
        let port = crate::loopback::free_port();
        let secret = RunSecret::from_text("a membership test's secret");
        let host = crate::serve_rendezvous(
            "127.0.0.1",
            port,
            Duration::from_secs(20),
            secret.clone(),
            runtime.handle(),
        )
        .unwrap();
        let shape = Shape {
            min: 1,
            max: 2,
            local: 1,
        };
        let liveness = Duration::from_secs(3);
        let mut coordinator = Coordinator::start(&host, shape, liveness, runtime.handle());
        let main = format!("127.0.0.1:{port}");
        let connect_within = |shape: Shape, secret: &RunSecret, within: u64| {
            MemberLink::connect(
                &main,
                1,
                shape,
                secret,
                liveness,
                Duration::from_secs(within),
                runtime.handle(),
                || false,
            )
            .map(|link| link.expect("not stopped"))
        };
        let connect = |shape: Shape, secret: &RunSecret| connect_within(shape, secret, 10);
        // The coordinator hears its connections when asked (its launcher asks every 20 ms).
        let wait = |link: &mut MemberLink, coordinator: Option<&mut Coordinator>| {
            let start = Instant::now();
            let mut coordinator = coordinator;
            loop {
                if let Some(order) = link.try_next() {
                    return order;
                }
                if let Some(coordinator) = coordinator.as_deref_mut() {
                    coordinator.pump();
                }
                assert!(start.elapsed() < Duration::from_secs(10), "no order came");
                std::thread::sleep(Duration::from_millis(10));
            }
        };

        // A launcher of another shape is refused, saying what to change.
        let mut odd = connect(Shape { local: 2, ..shape }, &secret).unwrap();
        match wait(&mut odd, Some(&mut coordinator)) {
            Order::Refused(why) => assert!(why.contains("--num-processes"), "{why}"),
            other => panic!("{other:?}"),
        }
        // One without the secret never joins.
        let stranger = RunSecret::from_text("not the secret");
        if let Ok(mut link) = connect_within(shape, &stranger, 1) {
            assert!(matches!(wait(&mut link, None), Order::Lost(_)));
        }

        let mut link = connect(shape, &secret).unwrap();
        let machines = coordinator
            .gather(Duration::from_secs(30), Duration::from_secs(10), || false)
            .unwrap()
            .unwrap();
        assert_eq!(machines, [0, 1]);
        coordinator.begin(0, &machines);
        assert_eq!(
            wait(&mut link, Some(&mut coordinator)),
            Order::Start(AttemptPlan {
                attempt: 0,
                machine_rank: 1,
                machines: vec![0, 1]
            })
        );
        assert_eq!(coordinator.state(0), AttemptState::Running);
        // It fails: the attempt fails, naming it; told to stop, it is ready again.
        link.ended(0, false, "process 1 exited with status 3");
        let start = Instant::now();
        let failed = loop {
            if let AttemptState::Failed(why) = coordinator.state(0) {
                break why;
            }
            assert!(start.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(failed, "machine 1: process 1 exited with status 3");
        let machines = coordinator
            .gather(Duration::from_secs(30), Duration::from_secs(10), || false)
            .unwrap()
            .unwrap();
        coordinator.begin(1, &machines);
        assert!(
            matches!(wait(&mut link, Some(&mut coordinator)), Order::Start(p) if p.attempt == 1)
        );
        // Its launcher dies: the attempt fails at once, and the next one, after the window,
        // has the coordinator alone.
        drop(link);
        let start = Instant::now();
        let failed = loop {
            if let AttemptState::Failed(why) = coordinator.state(1) {
                break why;
            }
            assert!(
                start.elapsed() < liveness,
                "the loss took the liveness timeout"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            failed.contains("machine 1: its launcher was lost"),
            "{failed}"
        );
        let start = Instant::now();
        let machines = coordinator
            .gather(Duration::from_millis(500), Duration::from_secs(10), || {
                false
            })
            .unwrap()
            .unwrap();
        assert_eq!(machines, [0]);
        assert!(start.elapsed() >= Duration::from_millis(500));
        coordinator.begin(2, &machines);
        assert_eq!(coordinator.state(2), AttemptState::Succeeded);
        // Back again: it joins, and the run's end reaches it.
        let mut link = connect(shape, &secret).unwrap();
        let machines = coordinator
            .gather(Duration::from_secs(30), Duration::from_secs(10), || false)
            .unwrap()
            .unwrap();
        assert_eq!(machines, [0, 1]);
        coordinator.finish(true, "every process succeeded");
        assert!(matches!(
            wait(&mut link, None),
            Order::Finished { ok: true, .. }
        ));
    }
}
