//! The run's secret: what every connection between a run's processes, and to its rendezvous,
//! proves it knows (see the engine's handshake), so that nothing joins a run without it.

use super::env;
use super::error::DistributedError;

/// A run's shared secret. Its `Debug` does not show it.
///
/// `burn-accelerate launch` makes one for a run of one machine; a run of several machines needs
/// the same on every machine (`burn-accelerate secret PATH` writes one; give it to each launcher
/// with `--secret-file PATH`, or set [`SECRET`](env::SECRET)). Under torchrun without one, it is
/// derived from torchrun's run id (`TORCHELASTIC_RUN_ID`, random with `--standalone`), which
/// only the run's processes have.
///
/// It also carries the attempt of the run it admits to (0 for the first start, `n` after `n`
/// restarts: `burn-accelerate launch --max-restarts`, or torchrun's), read from
/// [`RESTART_COUNT`](env::RESTART_COUNT) or torchrun's
/// [`TORCHRUN_RESTART_COUNT`](env::TORCHRUN_RESTART_COUNT). The rendezvous hears only the
/// processes of its current attempt: one left over from an earlier attempt is refused, so it
/// can never take a place in a restarted run.
///
/// ```
/// use burn_accelerate_comm::RunSecret;
///
/// let secret = RunSecret::generate()?;
/// assert_eq!(secret.to_text().len(), 64); // 32 random bytes, in hex
/// assert_eq!(RunSecret::from_text(&secret.to_text()), secret);
/// assert_eq!(format!("{secret:?}"), "RunSecret(.., attempt 0)");
/// assert_eq!(secret.clone().for_attempt(2).attempt(), 2);
/// # Ok::<(), burn_accelerate_comm::DistributedError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RunSecret {
    key: Vec<u8>,
    attempt: u64,
}

impl std::fmt::Debug for RunSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunSecret(.., attempt {})", self.attempt)
    }
}

impl RunSecret {
    /// A fresh secret: 32 bytes from the operating system's generator.
    ///
    /// # Errors
    /// [`DistributedError::Io`] when the operating system has no random bytes to give.
    pub fn generate() -> Result<Self, DistributedError> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| DistributedError::Io {
            what: "drawing a run secret".into(),
            reason: e.to_string(),
        })?;
        Ok(Self::from_text(&hex(&bytes)))
    }

    /// The secret whose text (a file's contents, a variable's value) is `text`, without
    /// surrounding whitespace.
    /// The first attempt's.
    pub fn from_text(text: &str) -> Self {
        Self {
            key: text.trim().as_bytes().to_vec(),
            attempt: 0,
        }
    }

    /// Its text, as [`from_text`](Self::from_text) reads it back (without the attempt, which
    /// travels in its own variable).
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.key).into_owned()
    }

    /// The same secret for attempt `attempt` of the run (0: the first start).
    pub fn for_attempt(self, attempt: u64) -> Self {
        Self { attempt, ..self }
    }

    /// The attempt of the run it admits to: 0 for the first start, `n` after `n` restarts.
    pub fn attempt(&self) -> u64 {
        self.attempt
    }

    /// Its bytes, the key of the handshake's HMAC.
    pub(crate) fn key(&self) -> &[u8] {
        &self.key
    }

    /// The secret the environment gives: [`env::SECRET`], else one derived from torchrun's run
    /// id; `None` when neither is set. Its attempt is [`restart_count`](crate::restart_count)'s.
    ///
    /// # Errors
    /// [`DistributedError::InvalidVariable`] for an empty [`env::SECRET`] or a restart count
    /// that is not a number.
    pub fn from_vars(
        var: &impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, DistributedError> {
        let attempt = restart_count(var)?;
        if let Some(text) = var(env::SECRET) {
            if text.trim().is_empty() {
                return Err(DistributedError::InvalidVariable {
                    name: env::SECRET,
                    value: String::new(),
                    expected: "the run's secret (`burn-accelerate secret` writes one)".into(),
                });
            }
            return Ok(Some(Self::from_text(&text).for_attempt(attempt)));
        }
        Ok(var(env::TORCHRUN_RUN_ID)
            .filter(|id| !id.trim().is_empty())
            .map(|id| Self::from_text(&format!("torchrun:{}", id.trim())).for_attempt(attempt)))
    }
}

/// Which attempt of the run this process belongs to: [`env::RESTART_COUNT`] (set by
/// `burn-accelerate launch`), else torchrun's [`env::TORCHRUN_RESTART_COUNT`], else 0.
///
/// # Errors
/// [`DistributedError::InvalidVariable`] for a value that is not a whole number.
pub(crate) fn restart_count(
    var: &impl Fn(&str) -> Option<String>,
) -> Result<u64, DistributedError> {
    for name in [env::RESTART_COUNT, env::TORCHRUN_RESTART_COUNT] {
        if let Some(value) = var(name) {
            return value
                .trim()
                .parse()
                .map_err(|_| DistributedError::InvalidVariable {
                    name,
                    value,
                    expected: "the number of times the run was restarted (0 at its first start), \
                               as the launcher sets it: unset it when starting processes by hand"
                        .into(),
                });
        }
    }
    Ok(0)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_from_the_variable_or_torchrun_and_are_never_printed() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let given = RunSecret::from_vars(&vars(&[(env::SECRET, " abc\n")])).unwrap();
        assert_eq!(given, Some(RunSecret::from_text("abc")));
        let torchrun = RunSecret::from_vars(&vars(&[(env::TORCHRUN_RUN_ID, "f00d")])).unwrap();
        assert_eq!(torchrun.unwrap().key(), b"torchrun:f00d");
        // torchrun's restarts, and the launcher's own name for them, which wins.
        let restarted = RunSecret::from_vars(&vars(&[
            (env::TORCHRUN_RUN_ID, "f00d"),
            (env::TORCHRUN_RESTART_COUNT, "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (restarted.key(), restarted.attempt()),
            (&b"torchrun:f00d"[..], 2)
        );
        let ours = RunSecret::from_vars(&vars(&[
            (env::SECRET, "abc"),
            (env::RESTART_COUNT, "1"),
            (env::TORCHRUN_RESTART_COUNT, "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(ours, RunSecret::from_text("abc").for_attempt(1));
        assert_ne!(ours, RunSecret::from_text("abc"));
        let err = RunSecret::from_vars(&vars(&[(env::SECRET, "abc"), (env::RESTART_COUNT, "one")]))
            .unwrap_err();
        assert!(err.to_string().contains(env::RESTART_COUNT), "{err}");
        assert_eq!(RunSecret::from_vars(&vars(&[])).unwrap(), None);
        let err = RunSecret::from_vars(&vars(&[(env::SECRET, "  ")])).unwrap_err();
        assert!(err.to_string().contains(env::SECRET), "{err}");
        let a = RunSecret::generate().unwrap();
        assert_ne!(a, RunSecret::generate().unwrap());
        assert!(!format!("{a:?}").contains(&a.to_text()));
    }
}
