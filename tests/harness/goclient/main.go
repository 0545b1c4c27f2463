// Command goclient makes CRI calls the way kubelet does, with grpc-go, so that tests can check
// that cpushim works with kubelet's real gRPC stack and not only with grpcio and python h2.
//
//	goclient -addr unix:///path/to/cri.sock -method /runtime.v1.RuntimeService/Version \
//	    [-request-hex HEX] [-method M2 [-request-hex HEX2]]... [-calls N] [-timeout 10s] [-print-replies]
//
// It makes N calls of each method in sequence on one connection, interleaving the methods
// (M1, M2, M1, M2, ...), and prints one JSON line per call, then a JSON summary line. The i-th
// -request-hex is the request of the i-th -method (an empty message when left out). Mixing
// methods on one connection is the point: cpushim answers some calls itself and splices
// others, and every later call must still be understood by the runtime.
//
// Exit status: 0 when every call was made (whatever status each call got), 1 when the
// connection could not be set up, 2 for a usage error.
//
// It is built offline from Debian's packaged sources (golang-google-grpc-dev, grpc-go 1.33) in
// GOPATH mode, so it uses only what that version has and needs no generated CRI code:
// requests and replies travel as raw protobuf bytes through a pass-through codec.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// kubelet's limit on a CRI reply (pkg/kubelet/cri/remote: maxMsgSize).
const maxMsgSize = 16 * 1024 * 1024

// rawCodec passes messages through as the protobuf bytes they already are. Its Name is never
// sent: with grpc.ForceCodec alone, grpc-go 1.33 keeps the content-type "application/grpc",
// which is what kubelet sends, and the server decodes the bytes with its own proto codec.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	// grpc-go may reuse its receive buffer after Unmarshal returns.
	*b = append((*b)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "raw" }

type callResult struct {
	Call         int    `json:"call"`
	Method       string `json:"method"`
	Code         uint32 `json:"code"`
	CodeName     string `json:"code_name"`
	Message      string `json:"message"`
	ReplyLength  int    `json:"reply_length"`
	ReplySHA256  string `json:"reply_sha256"`
	ReplyHex     string `json:"reply_hex,omitempty"`
	ElapsedMicro int64  `json:"elapsed_us"`
}

type summary struct {
	Summary      bool                      `json:"summary"`
	Methods      []string                  `json:"methods"`
	Calls        int                       `json:"calls"`
	Codes        map[string]map[string]int `json:"codes"`
	ElapsedMicro int64                     `json:"elapsed_us"`
}

// stringList is a flag that may be given several times.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var methods, requestHexes stringList
	addr := flag.String("addr", "", "CRI endpoint, unix:///path/to/socket")
	flag.Var(&methods, "method", "full method, e.g. /runtime.v1.RuntimeService/Version (repeatable)")
	flag.Var(&requestHexes, "request-hex", "request of the matching -method as hex protobuf bytes (repeatable)")
	calls := flag.Int("calls", 1, "calls of each method, made in sequence on one connection")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of each call")
	printReplies := flag.Bool("print-replies", false, "include each reply's bytes (hex) in its line")
	flag.Parse()

	path := strings.TrimPrefix(*addr, "unix://")
	if path == *addr || path == "" || len(methods) == 0 || len(requestHexes) > len(methods) || *calls < 1 {
		fmt.Fprintln(os.Stderr, "usage: goclient -addr unix:///path -method /pkg.Service/Method [-request-hex HEX]... [-calls N]")
		os.Exit(2)
	}
	requests := make([][]byte, len(methods))
	for i, h := range requestHexes {
		request, err := hex.DecodeString(strings.ReplaceAll(h, " ", ""))
		if err != nil {
			fmt.Fprintf(os.Stderr, "goclient: -request-hex %q: %v\n", h, err)
			os.Exit(2)
		}
		requests[i] = request
	}

	// As kubelet's remote runtime service dials (k8s.io/kubernetes pkg/kubelet/cri/remote):
	// the socket path as the target, a unix dialer, no TLS, a 16 MiB receive limit, and no
	// WithBlock, so the connection is made lazily by the first call.
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	dialCtx, cancelDial := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancelDial()
	conn, err := grpc.DialContext(dialCtx, path,
		grpc.WithInsecure(),
		grpc.WithContextDialer(dialer),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize)),
	)
	if err != nil {
		fmt.Fprintf(os.Stderr, "goclient: dial %s: %v\n", *addr, err)
		os.Exit(1)
	}
	defer conn.Close()

	out := json.NewEncoder(os.Stdout)
	codes := map[string]map[string]int{} // method -> status code name -> calls
	started := time.Now()
	for i := 0; i < *calls*len(methods); i++ {
		m := i % len(methods)
		result := invoke(conn, methods[m], requests[m], *timeout)
		result.Call = i
		if !*printReplies {
			result.ReplyHex = ""
		}
		if codes[result.Method] == nil {
			codes[result.Method] = map[string]int{}
		}
		codes[result.Method][result.CodeName]++
		if err := out.Encode(result); err != nil {
			fmt.Fprintf(os.Stderr, "goclient: %v\n", err)
			os.Exit(1)
		}
	}
	err = out.Encode(summary{
		Summary:      true,
		Methods:      methods,
		Calls:        *calls * len(methods),
		Codes:        codes,
		ElapsedMicro: time.Since(started).Microseconds(),
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "goclient: %v\n", err)
		os.Exit(1)
	}
}

func invoke(conn *grpc.ClientConn, method string, request []byte, timeout time.Duration) callResult {
	// A deadline per call, as kubelet sets one (its runtime request timeout) on every call.
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	in := request
	var reply []byte
	began := time.Now()
	err := conn.Invoke(ctx, method, &in, &reply, grpc.ForceCodec(rawCodec{}))
	elapsed := time.Since(began)
	st := status.Convert(err) // OK with an empty message when err is nil
	digest := sha256.Sum256(reply)
	return callResult{
		Method:       method,
		Code:         uint32(st.Code()),
		CodeName:     st.Code().String(),
		Message:      st.Message(),
		ReplyLength:  len(reply),
		ReplySHA256:  hex.EncodeToString(digest[:]),
		ReplyHex:     hex.EncodeToString(reply),
		ElapsedMicro: elapsed.Microseconds(),
	}
}
