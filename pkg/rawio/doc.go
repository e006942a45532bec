// Package rawio reads and writes non-blocking TCP sockets with raw system
// calls through their syscall.RawConn: the same poller, locks and
// deadlines as net.Conn, without the scheduler's system-call hand-off
// around a read(2) or write(2) that cannot block.
//
// On a busy host a thread is often preempted inside such a call; the
// runtime's monitor then takes its P away and wakes another thread for it,
// which costs more than the call. The proxy (pkg/proxy) relays every
// client and endpoint byte through it, and the KV event subscriber
// (pkg/kvevents) reads its publishers' streams through it.
//
// In: a *net.TCPConn (New returns nil for anything else, and on systems
// other than Linux). Out: a Conn with net.Conn's Read and Write
// semantics and errors. Under the race detector the calls go through
// syscall.Read and syscall.Write so the detector sees the socket's
// happens-before edges.
package rawio
