package api_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/api/client"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// selfSigned writes a certificate for 127.0.0.1 and its key to dir.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "loxilb-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_ = os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	_ = os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

func TestHTTPSAndToken(t *testing.T) {
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	st, err := store.OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	srv, err := api.New(api.Config{Token: "tok", TLSCert: cert, TLSKey: key}, api.Deps{Rules: control.New(st, lbrule.Settings{}, nil)})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	defer func() { cancel(); <-done }()
	port := ln.Addr().(*net.TCPAddr).Port

	good, _ := client.New(client.Config{Port: port, Protocol: "https", CACert: cert, Token: "tok"})
	if _, err := good.ListLB(ctx); err != nil {
		t.Fatalf("https with CA and token: %v", err)
	}
	unverified, _ := client.New(client.Config{Port: port, Protocol: "https", Token: "tok"})
	if _, err := unverified.ListLB(ctx); !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("an unknown CA must fail verification: %v", err)
	}
	noToken, _ := client.New(client.Config{Port: port, Protocol: "https", CACert: cert})
	var ae *client.APIError
	if _, err := noToken.ListLB(ctx); !errors.As(err, &ae) || ae.Status != 401 {
		t.Fatalf("missing token over https: %v", err)
	}
	plain, _ := client.New(client.Config{Port: port, Protocol: "http", Token: "tok"})
	if _, err := plain.ListLB(ctx); err == nil {
		t.Fatal("plain http to an https server must fail")
	}
}
