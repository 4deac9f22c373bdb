// nodeprobe: the workload image of the real-node tests (hack/localnode.py builds it FROM scratch).
//
//	nodeprobe serve ADDR          answer every HTTP GET with "hello from <hostname>"
//	nodeprobe get URL [SECONDS]   GET URL until it answers 200 (at most SECONDS, default 60), print
//	                              the body and exit 0; exit 1 with the last error otherwise
//
// Static (CGO_ENABLED=0), so Go's own resolver reads the pod's /etc/resolv.conf: a name like
// svc.ns.svc.cluster.local goes to the cluster DNS the kubelet wrote there.
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: nodeprobe serve ADDR | get URL [SECONDS]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		host, _ := os.Hostname()
		http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "hello from %s\n", host)
		})
		fmt.Println("serving on", os.Args[2])
		if err := http.ListenAndServe(os.Args[2], nil); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	case "get":
		limit := 60
		if len(os.Args) > 3 {
			limit, _ = strconv.Atoi(os.Args[3])
		}
		os.Exit(get(os.Args[2], time.Duration(limit)*time.Second))
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}

// get retries until the deadline: the Service's endpoints and the DNS record may lag the pod.
func get(url string, limit time.Duration) int {
	client := &http.Client{Timeout: 5 * time.Second}
	deadline := time.Now().Add(limit)
	var last error
	for attempt := 1; time.Now().Before(deadline); attempt++ {
		resp, err := client.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				fmt.Printf("GET %s -> %d after %d attempt(s): %s", url, resp.StatusCode, attempt, body)
				return 0
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		fmt.Fprintf(os.Stderr, "attempt %d: %v\n", attempt, err)
		time.Sleep(time.Second)
	}
	fmt.Fprintf(os.Stderr, "GET %s failed for %s: %v\n", url, limit, last)
	return 1
}
