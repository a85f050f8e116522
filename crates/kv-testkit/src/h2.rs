//! HTTP/2 below tonic, for tests of what the server does with a request before its body:
//! [`stalled_prefix_query`] sends a prefix query whose body never comes (hyper's client), and
//! [`RawConnection`] writes frames by hand, for a client that ignores the server's settings
//! (no conforming client opens more streams than the server allows).

use std::net::SocketAddr;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

pub use kv_indexer_proto::prefix_wire::PREFIX_PATH;

/// A request body that never arrives.
pub struct NeverEnds;

impl hyper::body::Body for NeverEnds {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

/// The answer to a stalled query: the response head (a refusal is trailers-only, so its
/// `grpc-status` is there).
pub type Stalled = JoinHandle<Result<http::Response<hyper::body::Incoming>, hyper::Error>>;

/// Sends a prefix query to `addr` on a connection of its own: its head, with `grpc-timeout`
/// when given, and a body that never comes. The task ends when the server answers.
pub async fn stalled_prefix_query(addr: SocketAddr, grpc_timeout: Option<&str>) -> Stalled {
    let tcp = TcpStream::connect(addr)
        .await
        .expect("connecting to the server");
    let (mut sender, connection) = hyper::client::conn::http2::handshake::<_, _, NeverEnds>(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("an HTTP/2 handshake");
    tokio::spawn(connection);
    let mut request = http::Request::post(format!("http://{addr}{PREFIX_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(timeout) = grpc_timeout {
        request = request.header("grpc-timeout", timeout);
    }
    let request = request.body(NeverEnds).expect("a valid request");
    tokio::spawn(async move { sender.send_request(request).await })
}

/// The frame types these tests use (RFC 9113, section 6).
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
/// RST_STREAM's code for a stream the server did not accept.
pub const REFUSED_STREAM: u32 = 0x7;

/// One frame read off the connection.
#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Bytes,
}

impl Frame {
    pub fn ends_stream(&self) -> bool {
        self.flags & END_STREAM != 0
    }
}

/// An HTTP/2 connection written by hand: it opens whatever streams it is told to.
pub struct RawConnection {
    tcp: TcpStream,
    read: BytesMut,
}

impl RawConnection {
    /// Connects, exchanges the preface and settings, and returns once the server's settings
    /// have been read and acknowledged (they apply from then on).
    pub async fn open(addr: SocketAddr) -> RawConnection {
        let tcp = TcpStream::connect(addr)
            .await
            .expect("connecting to the server");
        let mut connection = RawConnection {
            tcp,
            read: BytesMut::new(),
        };
        connection.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        connection.send(SETTINGS, 0, 0, &[]).await;
        loop {
            let frame = connection.next_frame().await;
            if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                connection.send(SETTINGS, ACK, 0, &[]).await;
                return connection;
            }
        }
    }

    /// Opens `stream` with a gRPC request head for `path` (no body yet).
    pub async fn send_head(&mut self, stream: u32, path: &str) {
        let mut block = BytesMut::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] {
            literal(&mut block, name, value);
        }
        self.send(HEADERS, END_HEADERS, stream, &block).await;
    }

    /// Sends `message` as the stream's whole gRPC body (uncompressed, length-prefixed).
    pub async fn send_body(&mut self, stream: u32, message: &[u8]) {
        let mut body = BytesMut::new();
        body.put_u8(0);
        body.put_u32(message.len() as u32);
        body.put_slice(message);
        self.send(DATA, END_STREAM, stream, &body).await;
    }

    /// The next frame the server sends.
    pub async fn next_frame(&mut self) -> Frame {
        loop {
            if self.read.len() >= 9 {
                let length = (usize::from(self.read[0]) << 16)
                    | (usize::from(self.read[1]) << 8)
                    | usize::from(self.read[2]);
                if self.read.len() >= 9 + length {
                    let mut head = self.read.split_to(9);
                    head.advance(3);
                    let kind = head.get_u8();
                    let flags = head.get_u8();
                    let stream = head.get_u32() & 0x7fff_ffff;
                    let payload = self.read.split_to(length).freeze();
                    return Frame {
                        kind,
                        flags,
                        stream,
                        payload,
                    };
                }
            }
            let read = self
                .tcp
                .read_buf(&mut self.read)
                .await
                .expect("reading from the server");
            assert!(read > 0, "the server closed the connection");
        }
    }

    /// Reads frames until one of `kind` on `stream` and returns it.
    pub async fn wait_for(&mut self, kind: u8, stream: u32) -> Frame {
        loop {
            let frame = self.next_frame().await;
            if frame.kind == kind && frame.stream == stream {
                return frame;
            }
            assert!(
                frame.kind != GOAWAY,
                "the server ended the connection: {frame:?}"
            );
        }
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let mut frame = BytesMut::with_capacity(9 + payload.len());
        let length = payload.len() as u32;
        frame.put_slice(&length.to_be_bytes()[1..]);
        frame.put_u8(kind);
        frame.put_u8(flags);
        frame.put_u32(stream);
        frame.put_slice(payload);
        self.write(&frame).await;
    }

    async fn write(&mut self, bytes: &[u8]) {
        self.tcp
            .write_all(bytes)
            .await
            .expect("writing to the server");
    }
}

/// A header as an HPACK literal without indexing and without Huffman coding (RFC 7541,
/// section 6.2.2): short names and values only.
fn literal(block: &mut BytesMut, name: &str, value: &str) {
    assert!(name.len() < 127 && value.len() < 127, "a long header");
    block.put_u8(0);
    block.put_u8(name.len() as u8);
    block.put_slice(name.as_bytes());
    block.put_u8(value.len() as u8);
    block.put_slice(value.as_bytes());
}

/// The error code of a RST_STREAM frame.
pub fn reset_code(frame: &Frame) -> u32 {
    assert_eq!(frame.kind, RST_STREAM, "not a RST_STREAM: {frame:?}");
    (&frame.payload[..]).get_u32()
}
