//! `cri-pull --address SOCK IMAGE...`: pulls images through containerd's CRI `PullImage`, the
//! way kubelet does (so the snapshotter sees the CRI labels), and prints how long each took.
//! Used by `make demo` and `make bench`; Kubernetes nodes do not need it.

use std::time::Instant;

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::{ImageSpec, PullImageRequest, RemoveImageRequest};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (address, rest) = match args.as_slice() {
        [flag, address, rest @ ..] if flag == "--address" && !rest.is_empty() => (address, rest),
        _ => {
            eprintln!("usage: cri-pull --address CONTAINERD_SOCK [--rm] IMAGE...");
            return std::process::ExitCode::from(2);
        }
    };
    let (remove, images) = match rest {
        [flag, images @ ..] if flag == "--rm" => (true, images),
        images => (false, images),
    };
    let channel = match vmdisk::api::unix::channel(address).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cri-pull: {}", e.chain());
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut client = ImageServiceClient::new(channel);
    for image in images {
        let spec = Some(ImageSpec {
            image: image.clone(),
            ..Default::default()
        });
        let t = Instant::now();
        let r = if remove {
            client
                .remove_image(RemoveImageRequest { image: spec })
                .await
                .map(|_| "removed".to_string())
        } else {
            client
                .pull_image(PullImageRequest {
                    image: spec,
                    ..Default::default()
                })
                .await
                .map(|r| format!("pulled as {}", r.into_inner().image_ref))
        };
        match r {
            Ok(what) => println!("{image}: {what} in {:.3} s", t.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("cri-pull: {image}: {}", e.message());
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
