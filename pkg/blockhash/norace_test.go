//go:build !race

package blockhash

const raceEnabled = false
