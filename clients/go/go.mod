module github.com/pagedserve/pagedserve/clients/go

// Pinned to the versions Debian bookworm ships (golang-google-grpc-dev, golang-google-protobuf-dev, ...), so the
// same go.mod builds online through the module proxy and offline against /usr/share/gocode (see build.sh).
// Every indirect module is listed: without them Go walks grpc's old go.mod and asks the network for its graph.
go 1.19

require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require (
	github.com/golang/protobuf v1.5.2 // indirect
	golang.org/x/net v0.7.0 // indirect
	golang.org/x/sys v0.5.0 // indirect
	golang.org/x/text v0.7.0 // indirect
)
