//! A loopback port this process keeps for a test's whole life, so that nothing else can take it
//! between a stop and a restart, and so that "nothing listens here" is a fact, not a race.
//!
//! The port is held by a socket that is bound but never listens (with `SO_REUSEPORT`, which
//! every listener made here shares): a connection to it is refused at once while no listener is
//! open, and served by the listener once one is. A port bound, read and dropped could be reused
//! by any other process before the test connects to it.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// A reserved `127.0.0.1` port; connections are refused until [`Port::listen`].
pub struct Port {
    _holder: TcpSocket,
    addr: SocketAddr,
}

impl Port {
    /// Reserves a free port.
    pub fn reserve() -> Port {
        let holder = reusable();
        holder
            .bind("127.0.0.1:0".parse().expect("a socket address"))
            .expect("binding 127.0.0.1:0");
        let addr = holder.local_addr().expect("a bound socket has an address");
        Port {
            _holder: holder,
            addr,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `tcp://127.0.0.1:<port>`, as ZMQ names it.
    pub fn tcp(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// A listener on the port (needs a Tokio runtime). Connections are refused again once every
    /// listener is closed.
    pub fn listen(&self) -> TcpListener {
        let socket = reusable();
        socket
            .bind(self.addr)
            .unwrap_or_else(|error| panic!("binding the reserved {}: {error}", self.addr));
        socket
            .listen(1024)
            .unwrap_or_else(|error| panic!("listening on {}: {error}", self.addr))
    }

    /// [`Port::listen`] as a std listener, for APIs that take one (ZMQ's `bind_listener`).
    pub fn listen_std(&self) -> std::net::TcpListener {
        self.listen()
            .into_std()
            .expect("a Tokio listener converts to std")
    }
}

fn reusable() -> TcpSocket {
    let socket = TcpSocket::new_v4().expect("a TCP socket");
    socket.set_reuseport(true).expect("SO_REUSEPORT");
    socket
}

#[cfg(test)]
mod tests {
    use super::Port;

    #[tokio::test]
    async fn refuses_until_a_listener_opens_and_after_it_closes() {
        let port = Port::reserve();
        let refused = tokio::net::TcpStream::connect(port.addr()).await;
        assert_eq!(
            refused.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        let listener = port.listen();
        let (_client, accepted) = tokio::join!(
            tokio::net::TcpStream::connect(port.addr()),
            listener.accept()
        );
        accepted.expect("the listener accepts");
        drop(listener);
        let refused = tokio::net::TcpStream::connect(port.addr()).await;
        assert_eq!(
            refused.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        // And the port can serve again: a restart on the same address.
        let _again = port.listen();
        tokio::net::TcpStream::connect(port.addr())
            .await
            .expect("the second listener accepts");
    }
}
