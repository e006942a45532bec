// Package e2e holds end-to-end scenarios: the real daemon process, engine
// emulators speaking the engines' wire formats on loopback addresses, and
// real HTTP through the mode-4 VIP.
package e2e
