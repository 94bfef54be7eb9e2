// Command soci-convert makes a SOCI-enabled image of an image a containerd holds, as SOCI's
// `soci convert` does (github.com/awslabs/soci-snapshotter's library at the version go.mod
// names; SOCI's CLI itself is in a module the Go module proxy does not serve): a SOCI index
// manifest v2 per platform and its zTOCs, and an image index that holds the image and them,
// stored in containerd's content store under the destination name, so `ctr images push` pushes
// it all.
//
//	soci-convert --address SOCK --namespace NS [--span-size N] [--min-layer-size N] SRC DST
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/awslabs/soci-snapshotter/soci"
	"github.com/awslabs/soci-snapshotter/soci/store"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
)

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd's socket")
	namespace := flag.String("namespace", "default", "containerd namespace")
	root := flag.String("root", "/var/lib/soci-snapshotter-grpc", "where SOCI keeps its artifacts database")
	spanSize := flag.Int64("span-size", 4<<20, "bytes of uncompressed data between zTOC checkpoints")
	minLayerSize := flag.Int64("min-layer-size", 10<<20, "layers smaller than this get no zTOC")
	flag.Parse()
	if flag.NArg() != 2 {
		fail(errors.New("usage: soci-convert [flags] SRC DST"))
	}
	src, dst := flag.Arg(0), flag.Arg(1)
	ctx := namespaces.WithNamespace(context.Background(), *namespace)
	client, err := containerd.New(*address)
	if err != nil {
		fail(err)
	}
	defer client.Close()
	img, err := client.ImageService().Get(ctx, src)
	if err != nil {
		fail(err)
	}
	blobs, err := store.NewContentStore(store.WithType(store.ContainerdContentStoreType),
		store.WithContainerdAddress(*address))
	if err != nil {
		fail(err)
	}
	if err := os.MkdirAll(*root, 0o700); err != nil {
		fail(err)
	}
	db, err := soci.NewDB(soci.ArtifactsDbPath(*root))
	if err != nil {
		fail(err)
	}
	builder, err := soci.NewIndexBuilder(client.ContentStore(), blobs,
		soci.WithSpanSize(*spanSize), soci.WithMinLayerSize(*minLayerSize),
		soci.WithBuildToolIdentifier("vmdisk bench (soci-convert)"), soci.WithArtifactsDb(db))
	if err != nil {
		fail(err)
	}
	batch, done, err := blobs.BatchOpen(ctx)
	if err != nil {
		fail(err)
	}
	defer done(ctx)
	// With garbage-collection labels (as `soci convert` leaves out when it pushes at once):
	// the converted image keeps its index and zTOCs in containerd until they are pushed.
	desc, err := builder.Convert(batch, img, soci.ConvertWithPlatforms(platforms.DefaultSpec()))
	if err != nil {
		fail(err)
	}
	converted := images.Image{Name: dst, Target: *desc}
	if _, err := client.ImageService().Create(ctx, converted); errors.Is(err, errdefs.ErrAlreadyExists) {
		_, err = client.ImageService().Update(ctx, converted)
		if err != nil {
			fail(err)
		}
	} else if err != nil {
		fail(err)
	}
	fmt.Println(desc.Digest)
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "soci-convert: %v\n", err)
	os.Exit(1)
}
