// Command nydus-convert makes a nydus image (RAFS v6) of an image a containerd holds, as
// `nerdctl image convert --nydus` and nydusify do: each layer packed by nydus's own builder
// (`nydus-image`, from crates.io nydus-rs) through nydus-snapshotter's converter library (at the
// version go.mod names), the bootstrap merged into its last layer, stored in containerd's
// content store under the destination name, so `ctr images push` pushes it. nydusify's module
// is not served by the Go module proxy; this is its conversion, in brief.
//
//	nydus-convert --address SOCK [--namespace NS] --builder PATH [--work-dir DIR] SRC DST
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images/converter"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	nydus "github.com/containerd/nydus-snapshotter/pkg/converter"
	"github.com/containerd/platforms"
)

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd's socket")
	namespace := flag.String("namespace", "default", "containerd namespace")
	builder := flag.String("builder", "nydus-image", "the nydus-image builder")
	workDir := flag.String("work-dir", os.TempDir(), "where the builder works")
	flag.Parse()
	if flag.NArg() != 2 {
		fail(errors.New("usage: nydus-convert [flags] SRC DST"))
	}
	src, dst := flag.Arg(0), flag.Arg(1)
	ctx := namespaces.WithNamespace(context.Background(), *namespace)
	client, err := containerd.New(*address)
	if err != nil {
		fail(err)
	}
	defer client.Close()
	// The builder's defaults, as nerdctl's and nydusify's: RAFS v6, its compressor and chunk
	// size, no prefetch list (nydusd then prefetches the whole image when told to).
	pack := nydus.PackOption{WorkDir: *workDir, BuilderPath: *builder, FsVersion: "6"}
	merge := nydus.MergeOption{WorkDir: *workDir, BuilderPath: *builder, FsVersion: "6", OCI: true}
	layer := nydus.LayerConvertFunc(pack)
	hooks := converter.ConvertHooks{PostConvertHook: nydus.ConvertHookFunc(merge)}
	platform := platforms.Only(platforms.DefaultSpec())
	img, err := converter.Convert(ctx, client, dst, src,
		converter.WithIndexConvertFunc(converter.IndexConvertFuncWithHook(layer, true, platform, hooks)))
	if err != nil {
		fail(err)
	}
	fmt.Println(img.Target.Digest)
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "nydus-convert: %v\n", err)
	os.Exit(1)
}
