//go:build linux

// Package conformance runs containerd's snapshotter conformance suite
// (snapshots/testsuite of the containerd source it is built against: 1.6, 1.7
// or 2.x) against vmdisk-snapshotter over the Snapshots gRPC API, as
// containerd's proxy plugin reaches it. build.sh builds it offline from
// Debian's packaged containerd source; integration/deps/conformance.rs runs it in
// `make test`.
//
// The suite hands every subtest a fresh root (well over a socket address
// long); each gets its own daemon with that root, started from
// $VMDISK_SNAPSHOTTER with a configuration written beside it. Run as root: the
// suite mounts what the daemon returns.
package conformance

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/snapshots"
	"github.com/containerd/containerd/snapshots/proxy"
	"github.com/containerd/containerd/snapshots/testsuite"
	"google.golang.org/grpc"
)

func TestVmdiskSnapshotter(t *testing.T) {
	if os.Getenv("VMDISK_SNAPSHOTTER") == "" {
		t.Fatal("VMDISK_SNAPSHOTTER names the vmdisk-snapshotter binary to test")
	}
	if os.Getuid() != 0 {
		t.Fatal("the suite mounts snapshots: run it as root")
	}
	// The suite's name for what it runs: vmdisk serves ordinary snapshots as containerd's
	// overlayfs does, with overlay mounts (no redirect_dir), and the suites of 1.7 and later
	// exempt exactly overlayfs from renaming a lower layer's directory, which overlay cannot
	// do without redirect_dir; 1.6's suite skips that test for everyone.
	testsuite.SnapshotterSuite(t, "overlayfs", start)
}

// start is the suite's SnapshotterFunc: a daemon whose root is under the
// suite's root, and a proxy snapshotter talking to it.
func start(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
	state := filepath.Join(root, "vmdisk")
	// The snapshots socket is containerd's to dial, so it must fit a socket
	// address; everything else lives under the long root.
	sockets, err := os.MkdirTemp("/tmp", "vmdisk-suite-")
	if err != nil {
		return nil, nil, err
	}
	sock := filepath.Join(sockets, "s.sock")
	config := filepath.Join(root, "vmdisk.toml")
	text := fmt.Sprintf("root = %q\naddress = %q\nmanage_address = %q\nready_dir = %q\n[registry]\nhosts_dir = %q\n[containerd]\nroot = %q\n",
		state, sock, filepath.Join(state, "manage.sock"), filepath.Join(state, "disks"), filepath.Join(root, "hosts"), filepath.Join(root, "no-containerd"))
	if err := os.WriteFile(config, []byte(text), 0o600); err != nil {
		return nil, nil, err
	}
	log, err := os.Create(filepath.Join(os.TempDir(), filepath.Base(sockets)+".log"))
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(os.Getenv("VMDISK_SNAPSHOTTER"), "--config", config)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		log.Close()
		os.RemoveAll(sockets)
		return mount.UnmountAll(state, syscall.MNT_DETACH)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
			break
		}
		select {
		case err := <-exited:
			exited <- err
			stop()
			return nil, nil, fmt.Errorf("vmdisk-snapshotter exited (%v); see %s", err, log.Name())
		default:
		}
		if time.Now().After(deadline) {
			stop()
			return nil, nil, fmt.Errorf("vmdisk-snapshotter did not listen on %s within 20 s; see %s", sock, log.Name())
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := grpc.Dial("unix://"+sock, grpc.WithInsecure())
	if err != nil {
		stop()
		return nil, nil, err
	}
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "vmdisk")
	return sn, func() error {
		conn.Close()
		if err := stop(); err != nil {
			return err
		}
		os.Remove(log.Name())
		return nil
	}, nil
}
