// Package layering holds the test that enforces the import rules between the
// repository's layers (ARCHITECTURE.md, "Layering"). The rules were kept by
// review alone; a test makes a forbidden import fail `make test` instead of
// waiting for a reader to notice it.
package layering
