package api_test

import "fmt"

func fmtSscanf(s string, p *int) (int, error) { return fmt.Sscanf(s, "%d", p) }
