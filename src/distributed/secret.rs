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
/// ```
/// use burn_accelerate::distributed::RunSecret;
///
/// let secret = RunSecret::generate()?;
/// assert_eq!(secret.to_text().len(), 64); // 32 random bytes, in hex
/// assert_eq!(RunSecret::from_text(&secret.to_text()), secret);
/// assert_eq!(format!("{secret:?}"), "RunSecret(..)");
/// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RunSecret(Vec<u8>);

impl std::fmt::Debug for RunSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunSecret(..)")
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
    pub fn from_text(text: &str) -> Self {
        Self(text.trim().as_bytes().to_vec())
    }

    /// Its text, as [`from_text`](Self::from_text) reads it back.
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// Its bytes, the key of the handshake's HMAC.
    pub(crate) fn key(&self) -> &[u8] {
        &self.0
    }

    /// The secret the environment gives: [`env::SECRET`], else one derived from torchrun's run
    /// id; `None` when neither is set.
    ///
    /// # Errors
    /// [`DistributedError::InvalidVariable`] for an empty [`env::SECRET`].
    pub(crate) fn from_vars(
        var: &impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, DistributedError> {
        if let Some(text) = var(env::SECRET) {
            if text.trim().is_empty() {
                return Err(DistributedError::InvalidVariable {
                    name: env::SECRET,
                    value: String::new(),
                    expected: "the run's secret (`burn-accelerate secret` writes one)".into(),
                });
            }
            return Ok(Some(Self::from_text(&text)));
        }
        Ok(var(env::TORCHRUN_RUN_ID)
            .filter(|id| !id.trim().is_empty())
            .map(|id| Self::from_text(&format!("torchrun:{}", id.trim()))))
    }
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
        assert_eq!(RunSecret::from_vars(&vars(&[])).unwrap(), None);
        let err = RunSecret::from_vars(&vars(&[(env::SECRET, "  ")])).unwrap_err();
        assert!(err.to_string().contains(env::SECRET), "{err}");
        let a = RunSecret::generate().unwrap();
        assert_ne!(a, RunSecret::generate().unwrap());
        assert!(!format!("{a:?}").contains(&a.to_text()));
    }
}
