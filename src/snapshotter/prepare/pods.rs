//! Pods whose pulls and containers use different snapshotters.
//!
//! containerd 1.7 and 2.x take a CRI pull's snapshotter from the pod's
//! `io.containerd.cri.runtime-handler` annotation, but its containers' from the handler the
//! sandbox runs on. A pod annotated for a VM handler (whose snapshotter is vmdisk) but left on
//! another (no RuntimeClass: runc on overlayfs) is pulled lazily into vmdisk, then its
//! containers are made on the other snapshotter from content containerd never downloaded —
//! containerd 1.7 and 2.x fail them (`content digest … not found`). vmdisk sees only the pull;
//! after each lazy pull it asks containerd's CRI for the running sandboxes and warns, once per
//! pod, of each whose annotation names a handler of another snapshotter than the one it runs
//! on.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tokio::sync::Notify;

/// The pod annotation a CRI pull takes its snapshotter from.
pub const ANN_RUNTIME_HANDLER: &str = "io.containerd.cri.runtime-handler";
/// How long one look at containerd may take.
const DEADLINE: Duration = Duration::from_secs(5);
/// Sandboxes remembered as warned of, at most (then all are forgotten, and a pod still
/// misplaced is warned of again).
const WARNED_MAX: usize = 4096;

/// Which snapshotter each runtime handler uses, from containerd's CRI configuration (its
/// `Status` with `verbose`): a handler's own `snapshotter`, else the default one.
#[derive(Debug, Default)]
pub struct Handlers {
    snapshotters: HashMap<String, String>,
    default_handler: String,
    default_snapshotter: String,
}

impl Handlers {
    /// From the CRI configuration's JSON (`config` of the verbose status); `None` if it has no
    /// runtimes.
    pub fn from_config(config: &serde_json::Value) -> Option<Self> {
        let containerd = &config["containerd"];
        let runtimes = containerd["runtimes"].as_object()?;
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let default_snapshotter = match text(&containerd["snapshotter"]) {
            s if s.is_empty() => "overlayfs".to_string(),
            s => s,
        };
        Some(Handlers {
            snapshotters: runtimes
                .iter()
                .map(|(name, r)| (name.clone(), text(&r["snapshotter"])))
                .collect(),
            default_handler: match text(&containerd["defaultRuntimeName"]) {
                s if s.is_empty() => "runc".to_string(),
                s => s,
            },
            default_snapshotter,
        })
    }

    fn name<'a>(&'a self, handler: &'a str) -> &'a str {
        match handler {
            "" => &self.default_handler,
            h => h,
        }
    }

    /// The snapshotter of `handler` (`""`: the default handler); `None` for one containerd
    /// does not know.
    pub fn snapshotter(&self, handler: &str) -> Option<&str> {
        let own = self.snapshotters.get(self.name(handler))?;
        Some(match own.as_str() {
            "" => &self.default_snapshotter,
            s => s,
        })
    }

    /// The warning for a sandbox running on `runs_on` whose annotation names `annotated`, if
    /// their snapshotters differ.
    pub fn mismatch(&self, pod: &str, annotated: &str, runs_on: &str) -> Option<String> {
        let pulls = self.snapshotter(annotated)?;
        let makes = self
            .snapshotter(runs_on)
            .unwrap_or(&self.default_snapshotter);
        (pulls != makes).then(|| {
            format!(
                "pod {pod} asks for runtime handler {annotated:?} in its {ANN_RUNTIME_HANDLER} annotation but runs on handler {:?}: its images are pulled into snapshotter {pulls:?} and its containers made on {makes:?} from content containerd never downloaded (containerd 1.7 and 2.x fail them: `content digest … not found`). Give the pod handler {annotated:?}'s RuntimeClass (runtimeClassName; KubeVirt: spec.configuration.defaultRuntimeClass), or drop the annotation",
                self.name(runs_on)
            )
        })
    }
}

/// Looks at containerd's sandboxes each time `pulled` is notified (coalesced: one look for
/// any number of lazy pulls while one runs), warning once per pod; never ends.
pub async fn watch(containerd: &Path, pulled: Arc<Notify>) {
    let channel = crate::api::unix::lazy_channel(containerd);
    let mut warned: HashSet<String> = HashSet::new();
    loop {
        pulled.notified().await;
        let client = RuntimeServiceClient::new(channel.clone());
        match tokio::time::timeout(DEADLINE, look(client)).await {
            Ok(Ok(found)) => {
                for (id, warning) in found {
                    if warned.len() >= WARNED_MAX {
                        warned.clear();
                    }
                    if warned.insert(id) {
                        tracing::warn!("{warning}");
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(containerd = %containerd.display(), error = %e, "cannot ask containerd's CRI which handlers pods run on")
            }
            Err(_) => {
                tracing::debug!(containerd = %containerd.display(), "containerd's CRI did not say which handlers pods run on in time")
            }
        }
    }
}

/// The ready sandboxes whose annotation and handler use different snapshotters, with the
/// warning for each.
async fn look(
    mut client: RuntimeServiceClient<tonic::transport::Channel>,
) -> Result<Vec<(String, String)>, tonic::Status> {
    let status = client
        .status(cri::StatusRequest { verbose: true })
        .await?
        .into_inner();
    let config: serde_json::Value = status
        .info
        .get("config")
        .and_then(|c| serde_json::from_str(c).ok())
        .unwrap_or_default();
    let Some(handlers) = Handlers::from_config(&config) else {
        return Ok(Vec::new());
    };
    let sandboxes = client
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                state: Some(cri::PodSandboxStateValue {
                    state: cri::PodSandboxState::SandboxReady as i32,
                }),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .items;
    Ok(sandboxes
        .into_iter()
        .filter_map(|s| {
            let annotated = s.annotations.get(ANN_RUNTIME_HANDLER)?;
            let pod = s
                .metadata
                .as_ref()
                .map_or_else(|| s.id.clone(), |m| format!("{}/{}", m.namespace, m.name));
            let warning = handlers.mismatch(&pod, annotated, &s.runtime_handler)?;
            Some((s.id, warning))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_annotated_for_another_snapshotters_handler_is_named() {
        let config = serde_json::json!({"containerd": {
            "defaultRuntimeName": "runc",
            "runtimes": {
                "runc": {"snapshotter": ""},
                "kubevirt": {"snapshotter": "vmdisk"},
                "kata": {"snapshotter": ""},
            },
        }});
        let h = Handlers::from_config(&config).unwrap();
        assert_eq!(h.snapshotter(""), Some("overlayfs"));
        assert_eq!(h.snapshotter("kubevirt"), Some("vmdisk"));
        // Annotated kubevirt, on the default handler: the containers are made on overlayfs.
        let w = h.mismatch("default/virt-launcher", "kubevirt", "").unwrap();
        assert!(
            w.contains("default/virt-launcher")
                && w.contains("\"runc\"")
                && w.contains("RuntimeClass"),
            "{w}"
        );
        // The handler and its annotation agree; handlers of one snapshotter; an unknown one.
        assert_eq!(h.mismatch("p", "kubevirt", "kubevirt"), None);
        assert_eq!(h.mismatch("p", "kata", "runc"), None);
        assert_eq!(h.mismatch("p", "nonesuch", "runc"), None);
        assert!(Handlers::from_config(&serde_json::json!({})).is_none());
    }
}
