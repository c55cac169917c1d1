package client

// Version is this module's release; the matching git tag is clients/go/v<Version>.
const Version = "0.1.0"
