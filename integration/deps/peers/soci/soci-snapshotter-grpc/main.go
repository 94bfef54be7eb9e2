// Command soci-snapshotter-grpc runs SOCI's snapshotter (github.com/awslabs/soci-snapshotter,
// the library at the version go.mod names) as containerd's proxy plugin, for `make bench`.
// SOCI publishes its daemon's own main in a module the Go module proxy does not serve (it
// replaces the library with a local copy); this is the same wiring in brief, written here:
// the configuration file (SOCI's parser and defaults), docker config credentials, the
// default bbolt metadata store, the Snapshots service on a unix socket, a clean stop on
// SIGINT or SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/awslabs/soci-snapshotter/config"
	"github.com/awslabs/soci-snapshotter/fs"
	"github.com/awslabs/soci-snapshotter/metadata"
	"github.com/awslabs/soci-snapshotter/service"
	"github.com/awslabs/soci-snapshotter/service/keychain/dockerconfig"
	"github.com/awslabs/soci-snapshotter/service/resolver"
	"github.com/awslabs/soci-snapshotter/ztoc"
	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/log"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "/run/soci-snapshotter-grpc/soci-snapshotter-grpc.sock", "the Snapshots service's socket")
	configPath := flag.String("config", config.DefaultConfigPath, "SOCI's configuration file")
	root := flag.String("root", config.DefaultSociSnapshotterRootPath, "the snapshotter's root directory")
	level := flag.String("log-level", "info", "log level")
	flag.Parse()
	if err := log.SetLevel(*level); err != nil {
		fail(err)
	}
	ctx, cancel := context.WithCancel(log.WithLogger(context.Background(), log.L))
	defer cancel()
	cfg, err := config.NewConfigFromToml(*configPath)
	if err != nil {
		fail(err)
	}
	if err := os.MkdirAll(*root, 0o700); err != nil {
		fail(err)
	}
	db, err := bolt.Open(filepath.Join(*root, "metadata.db"), 0o600, &bolt.Options{
		NoFreelistSync:  true,
		InitialMmapSize: 64 << 20,
		FreelistType:    bolt.FreelistMapType,
	})
	if err != nil {
		fail(err)
	}
	store := func(sr *io.SectionReader, toc ztoc.TOC, opts ...metadata.Option) (metadata.Reader, error) {
		return metadata.NewReader(db, sr, toc, opts...)
	}
	rs, err := service.NewSociSnapshotterService(ctx, *root, &cfg.ServiceConfig,
		service.WithCredsFuncs([]resolver.Credential{dockerconfig.NewDockerConfigKeychain(ctx)}...),
		service.WithFilesystemOptions(fs.WithMetadataStore(store)))
	if err != nil {
		fail(err)
	}
	// containerd's proxy passes the namespace in the request's metadata.
	rpc := grpc.NewServer(grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if ns, ok := namespaces.Namespace(ctx); ok {
			ctx = namespaces.WithNamespace(ctx, ns)
		}
		return h(ctx, req)
	}))
	snapshotsapi.RegisterSnapshotsServer(rpc, snapshotservice.FromSnapshotter(rs))
	serve(rpc, *address)
	rs.Close()
}

// serve answers on `address` until SIGINT or SIGTERM.
func serve(rpc *grpc.Server, address string) {
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		fail(err)
	}
	_ = os.Remove(address)
	l, err := net.Listen("unix", address)
	if err != nil {
		fail(err)
	}
	go func() {
		if err := rpc.Serve(l); err != nil {
			fail(err)
		}
	}()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	<-signals
	rpc.Stop()
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "soci-snapshotter-grpc: %v\n", err)
	os.Exit(1)
}
