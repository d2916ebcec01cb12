//! The container images the cells run: the product's, built from the repository's `Dockerfile`,
//! and the pods' pause image, both made by `e2e/scripts/build-image.sh` without a registry or a
//! daemon (buildah) and imported into each cell's containerd.

use std::path::{Path, PathBuf};
use tokio::process::Command;

use crate::command::run_streamed;
use crate::error::{Error, Result, io_context};
use crate::paths;

/// The images the build script made, and the archives that carry them into containerd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    /// The product image, `localhost/replicator:<tag>` (the tag is derived from the binary).
    pub replicator: String,
    /// The pods' sandbox image, `localhost/pause:<version>`.
    pub pause: String,
    /// The directory holding `replicator.tar`, `pause.tar` and `images.env`.
    pub dir: PathBuf,
}

impl Images {
    /// Where the build script writes: `$REPLICATOR_IMAGES_DIR`, else `<target>/images`.
    pub fn dir() -> PathBuf {
        paths::non_empty_var("REPLICATOR_IMAGES_DIR")
            .map(|dir| paths::absolute(PathBuf::from(dir)))
            .unwrap_or_else(|| paths::target_dir().join("images"))
    }

    /// Runs the build script (its output streamed; it reuses what is unchanged) and reads what
    /// it made.
    ///
    /// # Errors
    /// The script fails, or its `images.env` lacks an image.
    pub async fn ensure() -> Result<Images> {
        let dir = Images::dir();
        let script = paths::workspace_root()
            .join("e2e")
            .join("scripts")
            .join("build-image.sh");
        run_streamed(
            Command::new("bash")
                .arg(&script)
                .env("REPLICATOR_IMAGES_DIR", &dir)
                .current_dir(paths::workspace_root()),
        )
        .await?;
        Images::read(&dir)
    }

    /// Reads `images.env` (`REPLICATOR_IMAGE=...`, `PAUSE_IMAGE=...`) in `dir`.
    pub fn read(dir: &Path) -> Result<Images> {
        let path = dir.join("images.env");
        let text = std::fs::read_to_string(&path).map_err(io_context(format!("reading {}", path.display())))?;
        let value = |key: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
                .map(|value| value.trim().trim_matches('"').to_owned())
                .filter(|value| !value.is_empty())
                .ok_or_else(|| Error::Config(format!("{} names no {key}", path.display())))
        };
        Ok(Images {
            replicator: value("REPLICATOR_IMAGE")?,
            pause: value("PAUSE_IMAGE")?,
            dir: dir.to_path_buf(),
        })
    }

    /// Each image with the archive that carries it, pause first.
    pub fn archives(&self) -> [(&str, PathBuf); 2] {
        [
            (self.pause.as_str(), self.dir.join("pause.tar")),
            (self.replicator.as_str(), self.dir.join("replicator.tar")),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_env_is_read() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("replicator-e2e-images-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("images.env"),
            "REPLICATOR_IMAGE=localhost/replicator:0123abcd\nPAUSE_IMAGE=localhost/pause:3.10\n",
        )?;
        let images = Images::read(&dir)?;
        assert_eq!(images.replicator, "localhost/replicator:0123abcd");
        assert_eq!(images.pause, "localhost/pause:3.10");
        assert_eq!(images.archives()[1].1, dir.join("replicator.tar"));
        std::fs::write(dir.join("images.env"), "PAUSE_IMAGE=localhost/pause:3.10\n")?;
        assert!(Images::read(&dir).is_err());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
