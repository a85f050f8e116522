//! The route of `MatchExternalKvPrefix`, the one hot RPC: served ahead of the generated
//! `KVIndexer` server, with the same codec settings, but with the hand-written wire of
//! `kv_indexer_proto::prefix_wire`: the request's hashes decoded a buffer chunk at a time, the
//! response encoded straight from the index rather than a generated message built with a
//! `String` per match. Every other method goes to the generated server.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::prefix_wire::{DecodedPrefixRequest, EncodedPrefixResponse};
use tonic::service::Routes;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::access::PREFIX_PATH;
use crate::service::{IndexerService, arrival, finish};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `routes` with `MatchExternalKvPrefix` answered by `service`'s encoder.
pub fn add(routes: Routes, service: IndexerService) -> Routes {
    let router = routes
        .into_axum_router()
        .route_service(PREFIX_PATH, PrefixRoute(service));
    Routes::from(router).prepare()
}

/// The HTTP side: decodes the request and frames the answer like the generated server does.
#[derive(Clone)]
struct PrefixRoute(IndexerService);

impl tower::Service<http::Request<axum::body::Body>> for PrefixRoute {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let method = PrefixMethod(self.0.clone());
        Box::pin(async move {
            let codec = ProstCodec::<EncodedPrefixResponse, DecodedPrefixRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), Some(MAX_MESSAGE_BYTES));
            Ok(grpc.unary(method, request).await)
        })
    }
}

/// The RPC side: the service's prefix query, recorded like every RPC.
struct PrefixMethod(IndexerService);

impl tonic::server::UnaryService<DecodedPrefixRequest> for PrefixMethod {
    type Response = EncodedPrefixResponse;
    type Future = BoxFuture<Result<Response<EncodedPrefixResponse>, Status>>;

    fn call(&mut self, request: Request<DecodedPrefixRequest>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move {
            let request = request.map(|decoded| decoded.0);
            let start = arrival(&request);
            let result = service.match_prefix_encoded(request).await;
            finish("MatchExternalKvPrefix", start, result)
        })
    }
}
