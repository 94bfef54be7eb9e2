// Command containerd-stargz-grpc runs stargz-snapshotter (github.com/containerd/
// stargz-snapshotter, the library at the version go.mod names) as containerd's proxy plugin,
// for `make bench`. Its own main is in a module the Go module proxy does not serve; this is
// the same wiring in brief, written here: the configuration file (stargz's `service.Config`),
// docker config credentials, the default in-memory metadata store, the Snapshots service on a
// unix socket, a clean stop on SIGINT or SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	stargzfs "github.com/containerd/stargz-snapshotter/fs"
	"github.com/containerd/stargz-snapshotter/metadata/memory"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/containerd/stargz-snapshotter/service/keychain/dockerconfig"
	"github.com/containerd/stargz-snapshotter/service/resolver"
	"github.com/pelletier/go-toml"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "/run/containerd-stargz-grpc/containerd-stargz-grpc.sock", "the Snapshots service's socket")
	configPath := flag.String("config", "", "stargz-snapshotter's configuration file")
	root := flag.String("root", "/var/lib/containerd-stargz-grpc", "the snapshotter's root directory")
	level := flag.String("log-level", "info", "log level")
	flag.Parse()
	if err := log.SetLevel(*level); err != nil {
		fail(err)
	}
	ctx := log.WithLogger(context.Background(), log.L)
	var cfg service.Config
	if *configPath != "" {
		tree, err := toml.LoadFile(*configPath)
		if err != nil {
			fail(err)
		}
		if err := tree.Unmarshal(&cfg); err != nil {
			fail(err)
		}
	}
	if err := service.Supported(*root); err != nil {
		fail(err)
	}
	rs, err := service.NewStargzSnapshotterService(ctx, *root, &cfg,
		service.WithCredsFuncs([]resolver.Credential{dockerconfig.NewDockerconfigKeychain(ctx)}...),
		service.WithFilesystemOptions(stargzfs.WithMetadataStore(memory.NewReader)))
	if err != nil {
		fail(err)
	}
	rpc := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(rpc, snapshotservice.FromSnapshotter(rs))
	if err := os.MkdirAll(filepath.Dir(*address), 0o700); err != nil {
		fail(err)
	}
	_ = os.Remove(*address)
	l, err := net.Listen("unix", *address)
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
	rs.Close()
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "containerd-stargz-grpc: %v\n", err)
	os.Exit(1)
}
