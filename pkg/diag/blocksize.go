package diag

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/kvevents"
)

// maxInfoBytes caps what is read of an engine's /metrics or
// /get_server_info: the block size is near the top of either.
const maxInfoBytes = 4 << 20

// blockSize compares the engine's own block size with kvBlockSize: vLLM
// publishes it as the block_size label of vllm:cache_config_info on
// /metrics, SGLang as page_size in /get_server_info.
func (s Sources) blockSize(ctx context.Context, line lineFunc, eng string, tls bool, hp string, want int) Check {
	scheme := "http"
	if tls {
		scheme = "https"
	}
	var got int
	var where string
	var err error
	switch eng {
	case kvevents.EngineVLLM:
		where = scheme + "://" + hp + "/metrics"
		got, err = s.fetch(ctx, where, vllmBlockSize)
	case kvevents.EngineSGLang:
		where = scheme + "://" + hp + "/get_server_info"
		got, err = s.fetch(ctx, where, sglangPageSize)
	default:
		return line(Warn, CheckBlockSize, hp, "engine "+eng+" does not report its block size", "")
	}
	if err != nil {
		return line(Warn, CheckBlockSize, hp, "could not read the engine's block size from "+where+": "+err.Error(),
			"check by hand that the engine's block size equals kvBlockSize "+strconv.Itoa(want))
	}
	if got != want {
		flag := "--block-size"
		if eng == kvevents.EngineSGLang {
			flag = "--page-size"
		}
		return line(Fail, CheckBlockSize, hp, fmt.Sprintf("engine block size %d, rule kvBlockSize %d", got, want),
			fmt.Sprintf("set kvBlockSize %d, or restart the engine with %s %d", got, flag, want))
	}
	return line(Pass, CheckBlockSize, hp, fmt.Sprintf("engine block size %d equals kvBlockSize", got), "")
}

func (s Sources) fetch(ctx context.Context, url string, parse func(io.Reader) (int, error)) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := s.Client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return parse(io.LimitReader(resp.Body, maxInfoBytes))
}

// vllmBlockSize finds block_size="N" on the vllm:cache_config_info line of
// a Prometheus text exposition.
func vllmBlockSize(r io.Reader) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "vllm:cache_config_info{") {
			continue
		}
		_, rest, ok := strings.Cut(l, `block_size="`)
		if !ok {
			return 0, fmt.Errorf("vllm:cache_config_info has no block_size label")
		}
		v, _, _ := strings.Cut(rest, `"`)
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return 0, fmt.Errorf("block_size label %q is not a positive integer", v)
		}
		return n, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no vllm:cache_config_info series")
}

// sglangPageSize reads page_size from /get_server_info.
func sglangPageSize(r io.Reader) (int, error) {
	var info struct {
		PageSize *int `json:"page_size"`
	}
	if err := json.NewDecoder(r).Decode(&info); err != nil {
		return 0, fmt.Errorf("not a JSON object: %v", err)
	}
	if info.PageSize == nil || *info.PageSize < 1 {
		return 0, fmt.Errorf("no positive page_size field")
	}
	return *info.PageSize, nil
}
